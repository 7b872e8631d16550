//! The committed PTX, executed by the PTX interpreter (`ptx-interp/`) for both modules
//! (sm_80 and sm_90), through the same one-shot step path the emulator runs
//! (`pagedkv::host::step::once`, the path engines use): every entry point of both
//! modules runs here, on awkward shapes (batch 17, lengths off the block size, shuffled
//! and shared block tables, windows, soft-cap, ALiBi, split-K, every dtype and fp8
//! cache), and each output equals the emulator's bit for bit in exact math and matches
//! the f64 reference. A test then checks that nothing the modules export went
//! unlaunched, so a new entry point without an interpreter test fails CI.

use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock, Mutex};

use crate::common;
use crate::prefill::{Prefill, prefill_case};
use common::case::{Case, Params, build};
use common::fp8::quantise_case;
use common::{rel_l2, rng, tolerance, uniform};
use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::attention::{DecodeInputs, SplitPlan, plan};
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::{paged_decode_attention, paged_prefill_attention};
use pagedkv::host::step::{EmuDevice, StepDevice, once};
use pagedkv::host::{AlignedBuf, DType, HostTensor};
use pagedkv::kernels::kernels::DecodeParams;
use pagedkv::kernels::{F16, PagedLayout};
use pagedkv_ptx_interp::{LaunchLog, MathMode, Module, PtxDevice};
use rand::Rng;
use rand::seq::SliceRandom;

/// Both committed modules, parsed once, and the log of every launch made on each.
struct Arch {
    module: Arc<Module>,
    logs: Mutex<Vec<LaunchLog>>,
}

static ARCHS: LazyLock<Vec<Arch>> = LazyLock::new(|| {
    pagedkv::ptx::ALL
        .iter()
        .map(|m| Arch::new(Module::parse(m.arch, m.ptx).expect("the committed PTX parses")))
        .collect()
});

impl Arch {
    fn new(module: Module) -> Self {
        Self {
            module: Arc::new(module),
            logs: Mutex::new(Vec::new()),
        }
    }

    /// A fresh interpreter device over this module, logged.
    fn device(&self) -> PtxDevice {
        let dev = PtxDevice::new(self.module.clone(), MathMode::Exact);
        self.logs.lock().unwrap().push(dev.log());
        dev
    }
}

/// What went wrong in a family's run: the first failure, as a message.
type Outcome = Result<(), String>;

/// The first element where two outputs differ, as a message (None: bit-identical).
fn first_difference(what: &str, got: &HostTensor, want: &HostTensor) -> Option<String> {
    let (g, w) = (got.buf().as_bytes(), want.buf().as_bytes());
    if g == w {
        return None;
    }
    let size = got.dtype().size();
    let i = (0..g.len()).find(|&i| g[i] != w[i]).unwrap() / size;
    Some(format!(
        "{what}: element {i} differs: interpreter {} vs emulator {}",
        got.get(i),
        want.get(i)
    ))
}

fn decode_on<D: StepDevice>(dev: D, c: &Case, plan: SplitPlan) -> Result<HostTensor, String> {
    let mut out = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    let inputs = DecodeInputs {
        plan: Some(plan),
        ..c.inputs()
    };
    once::decode(dev, None, inputs, &mut out).map_err(|e| format!("decode: {e}"))?;
    Ok(out)
}

/// The interpreter's output against the emulator's (bit for bit) and the reference.
fn check(what: &str, got: &HostTensor, emu: &HostTensor, want: &[f64], tol: f64) -> Outcome {
    if let Some(d) = first_difference(what, got, emu) {
        return Err(d);
    }
    let e = rel_l2(&got.to_f64(), want);
    if e.is_nan() || e > tol {
        return Err(format!("{what}: rel L2 {e:e} vs the reference"));
    }
    Ok(())
}

/// The decode cases: every query dtype and fp8 cache, batch 17 with ragged lengths,
/// GQA and MQA, window, soft-cap, ALiBi; each unsplit and split.
fn decode_cases() -> Vec<(Params, Option<DType>)> {
    let base = Params {
        dtype: DType::F16,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: 2,
        group: 4,
        batch: 17,
        max_len: 75,
        window: None,
        softcap: None,
        alibi: false,
        partition: Some(64),
        narrow_heads: false,
        seed: 1,
        full_length: false,
    };
    let mut v = Vec::new();
    for (i, dtype) in [DType::F32, DType::F16, DType::Bf16]
        .into_iter()
        .enumerate()
    {
        v.push((
            Params {
                dtype,
                seed: 10 + i as u64,
                ..base.clone()
            },
            None,
        ));
    }
    // Window + soft-cap + ALiBi, an MQA group of 8, head_dim 64, block 8.
    v.push((
        Params {
            dtype: DType::Bf16,
            head_dim: 64,
            block_size: 8,
            num_kv_heads: 1,
            group: 8,
            batch: 3,
            max_len: 90,
            window: Some(23),
            softcap: Some(12.0),
            alibi: true,
            seed: 20,
            ..base.clone()
        },
        None,
    ));
    for (i, (dtype, cache)) in [
        (DType::F16, DType::E4m3),
        (DType::F16, DType::E5m2),
        (DType::Bf16, DType::E4m3),
        (DType::Bf16, DType::E5m2),
    ]
    .into_iter()
    .enumerate()
    {
        v.push((
            Params {
                dtype,
                batch: 5,
                seed: 30 + i as u64,
                ..base.clone()
            },
            Some(cache),
        ));
    }
    v
}

fn decode_all(a: &Arch) -> Outcome {
    for (p, cache) in decode_cases() {
        let mut c = build(&p);
        if let Some(cache) = cache {
            quantise_case(&mut c, cache, true);
        }
        let want = paged_decode_attention(&c.inputs());
        let max_len = *c.lens.iter().max().unwrap() as u32;
        let unsplit = plan(&c.shape, p.dtype, max_len, 1);
        let part = p.partition.unwrap();
        let split = SplitPlan {
            partition_tokens: part,
            num_partitions: max_len.div_ceil(part),
            ..unsplit
        };
        for pl in [unsplit, split] {
            let what = format!("decode {:?} cache {cache:?}, {pl:?}", p.dtype);
            let emu = decode_on(EmuDevice::new(Emulator::new()), &c, pl)?;
            let got = decode_on(a.device(), &c, pl)?;
            check(&what, &got, &emu, &want, tolerance(p.dtype))?;
        }
    }
    Ok(())
}

fn prefill_all(a: &Arch) -> Outcome {
    let base = Params {
        dtype: DType::F16,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: 2,
        group: 2,
        batch: 3,
        max_len: 45,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed: 40,
        full_length: false,
    };
    let mut cases: Vec<(Params, Option<DType>)> = [DType::F32, DType::F16, DType::Bf16]
        .into_iter()
        .enumerate()
        .map(|(i, dtype)| {
            (
                Params {
                    dtype,
                    seed: 41 + i as u64,
                    ..base.clone()
                },
                None,
            )
        })
        .collect();
    cases.push((
        Params {
            head_dim: 64,
            block_size: 8,
            window: Some(13),
            softcap: Some(20.0),
            alibi: true,
            seed: 45,
            ..base.clone()
        },
        None,
    ));
    for (i, (dtype, cache)) in [
        (DType::F16, DType::E4m3),
        (DType::F16, DType::E5m2),
        (DType::Bf16, DType::E4m3),
        (DType::Bf16, DType::E5m2),
    ]
    .into_iter()
    .enumerate()
    {
        cases.push((
            Params {
                dtype,
                batch: 2,
                seed: 50 + i as u64,
                ..base.clone()
            },
            Some(cache),
        ));
    }
    for (p, cache) in cases {
        let mut pc = prefill_case(&p);
        if let Some(cache) = cache {
            quantise_case(&mut pc.c, cache, true);
        }
        let what = format!(
            "prefill {:?} cache {cache:?}, window {:?}",
            p.dtype, p.window
        );
        let want = paged_prefill_attention(&pc.inputs());
        let emu = prefill_on(EmuDevice::new(Emulator::new()), &pc)?;
        let got = prefill_on(a.device(), &pc)?;
        check(&what, &got, &emu, &want, tolerance(p.dtype))?;
    }
    Ok(())
}

fn prefill_on<D: StepDevice>(dev: D, pc: &Prefill) -> Result<HostTensor, String> {
    let mut out = HostTensor::full(pc.q.dtype(), pc.q.shape(), f64::NAN);
    once::prefill(dev, pc.inputs(), &mut out).map_err(|e| format!("prefill: {e}"))?;
    Ok(out)
}

fn kv_append_all(a: &Arch) -> Outcome {
    let cases = [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::E4m3),
        (DType::F16, DType::E5m2),
        (DType::Bf16, DType::E4m3),
        (DType::Bf16, DType::E5m2),
    ];
    for (i, (dtype, cache)) in cases.into_iter().enumerate() {
        let mut r = rng(60 + i as u64);
        let layout = PagedLayout {
            num_blocks: 7,
            num_kv_heads: 3,
            block_size: 16,
            head_dim: 64,
        };
        let row = (layout.num_kv_heads * layout.head_dim) as usize;
        let slots = (layout.num_blocks * layout.block_size) as i64;
        // 17 tokens at shuffled slots, two skipped (negative).
        let mut all: Vec<i64> = (0..slots).collect();
        all.shuffle(&mut r);
        let mut mapping: Vec<i64> = all[..17].to_vec();
        mapping[4] = -1;
        mapping[11] = -1;
        let n = mapping.len();
        let k = HostTensor::from_f64(dtype, &[n, row], &uniform(&mut r, n * row)).unwrap();
        let v = HostTensor::from_f64(dtype, &[n, row], &uniform(&mut r, n * row)).unwrap();
        let scales = (cache != dtype).then(|| KvScales {
            k: (0..3)
                .map(|h| 0.002 + 0.001 * h as f32 + r.random_range(0.0..0.001))
                .collect(),
            v: (0..3).map(|h| 0.003 + 0.001 * h as f32).collect(),
        });
        let pool = (slots as usize) * row;
        let run = |which: usize| -> Result<(HostTensor, HostTensor), String> {
            let mut kc = HostTensor::full(cache, &[pool], f64::NAN);
            let mut vc = HostTensor::full(cache, &[pool], f64::NAN);
            let io = KvAppendInputs {
                layout: &layout,
                key: &k,
                value: &v,
                slot_mapping: &mapping,
                key_cache: &mut kc,
                value_cache: &mut vc,
                scales: scales.as_ref(),
            };
            match which {
                0 => kv_append_reference(io),
                1 => once::kv_append(EmuDevice::new(Emulator::new()), io),
                _ => once::kv_append(a.device(), io),
            }
            .map_err(|e| format!("kv_append: {e}"))?;
            Ok((kc, vc))
        };
        let (kr, vr) = run(0)?;
        let (ke, ve) = run(1)?;
        let (kg, vg) = run(2)?;
        let what = format!("kv_append {dtype} into {cache}");
        for (g, e, w) in [(&kg, &ke, &kr), (&vg, &ve, &vr)] {
            if let Some(d) = first_difference(&what, g, e) {
                return Err(d);
            }
            if g.buf().as_bytes() != w.buf().as_bytes() {
                return Err(format!("{what}: differs from the reference"));
            }
        }
    }
    Ok(())
}

fn copy_blocks_all(a: &Arch) -> Outcome {
    // Blocks of 600 16-byte vectors (past the 4-way unrolled loop's 512 per pass of
    // 128 threads) and of 5 (the tail only), three pools, shuffled disjoint pairs.
    for (seed, vecs) in [(70u64, 600u64), (71, 5)] {
        let mut r = rng(seed);
        let block_bytes = 16 * vecs;
        let blocks = 9u32;
        let pools: Vec<AlignedBuf> = (0..3)
            .map(|_| {
                let bytes: Vec<u8> = (0..blocks as u64 * block_bytes)
                    .map(|_| r.random())
                    .collect();
                AlignedBuf::from_slice(&bytes)
            })
            .collect();
        let mut ids: Vec<u32> = (0..blocks).collect();
        ids.shuffle(&mut r);
        let pairs = vec![(ids[0], ids[5]), (ids[1], ids[6]), (ids[0], ids[7])];
        let run = |on_ptx: bool| -> Result<Vec<AlignedBuf>, String> {
            let mut pools = pools.clone();
            let raw: Vec<(u64, u64)> = pools
                .iter_mut()
                .map(|p| (p.as_bytes_mut().as_mut_ptr() as u64, p.len() as u64))
                .collect();
            // SAFETY: each pool is an AlignedBuf borrowed mutably for this call (16-byte
            // aligned host memory, the space both devices use), none overlapping.
            let r = if on_ptx {
                unsafe { once::copy_blocks(&mut a.device(), &raw, block_bytes, &pairs) }
            } else {
                let mut dev = EmuDevice::new(Emulator::new());
                unsafe { once::copy_blocks(&mut dev, &raw, block_bytes, &pairs) }
            };
            r.map_err(|e| format!("copy_blocks: {e}"))?;
            Ok(pools)
        };
        let (emu, got) = (run(false)?, run(true)?);
        for (p, (g, e)) in got.iter().zip(&emu).enumerate() {
            if g.as_bytes() != e.as_bytes() {
                return Err(format!("copy_blocks pool {p}, {vecs} vectors: differs"));
            }
        }
        // And the copies happened.
        let b = block_bytes as usize;
        let (s, d) = (pairs[0].0 as usize, pairs[0].1 as usize);
        assert_eq!(
            got[2].as_bytes()[d * b..(d + 1) * b],
            pools[2].as_bytes()[s * b..(s + 1) * b]
        );
    }
    Ok(())
}

/// Runs every family on module `arch`, then checks every entry point was launched.
fn every_entry_point(arch: usize) {
    let a = &ARCHS[arch];
    for family in [copy_blocks_all, kv_append_all, decode_all, prefill_all] {
        if let Err(e) = family(a) {
            panic!("{}: {e}", a.module.target());
        }
    }
    let launched: BTreeSet<&str> = a
        .logs
        .lock()
        .unwrap()
        .iter()
        .flat_map(|l| l.take())
        .map(|r| r.kernel)
        .collect();
    let all: BTreeSet<&str> = a.module.entry_points().into_iter().collect();
    let missing: Vec<_> = all.difference(&launched).collect();
    assert!(
        missing.is_empty(),
        "{}: entry points no interpreter test launches: {missing:?}",
        a.module.target()
    );
}

#[test]
fn sm_80_every_entry_point_matches_the_emulator_and_the_reference() {
    every_entry_point(0);
}

#[test]
fn sm_90_every_entry_point_matches_the_emulator_and_the_reference() {
    every_entry_point(1);
}

/// `ptx` with the first line of entry `kernel`'s body that contains `needle` rewritten
/// by `f` (None if there is no such line).
fn mutate(ptx: &str, kernel: &str, needle: &str, f: impl Fn(&str) -> String) -> Option<String> {
    let start = ptx.find(&format!(".entry {kernel}("))?;
    let end = ptx[start + 1..]
        .find(".entry ")
        .map_or(ptx.len(), |e| start + 1 + e);
    let at = start + ptx[start..end].find(needle)?;
    let line_start = ptx[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_end = at + ptx[at..].find('\n')?;
    let line = &ptx[line_start..line_end];
    let new = f(line);
    assert_ne!(new, line, "the mutation changes `{line}`");
    Some(format!("{}{}{}", &ptx[..line_start], new, &ptx[line_end..]))
}

/// The registers of the first `{...}` group of `line` at position `group`, swapped
/// pairwise at `i` and `j`.
fn swap_in_group(line: &str, group: usize, i: usize, j: usize) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut rest = line;
    let mut n = 0;
    while let Some(open) = rest.find('{') {
        let close = open + rest[open..].find('}').unwrap();
        parts.push(rest[..open + 1].to_string());
        let inner = &rest[open + 1..close];
        if n == group {
            let mut regs: Vec<&str> = inner.split(", ").collect();
            regs.swap(i, j);
            parts.push(regs.join(", "));
        } else {
            parts.push(inner.to_string());
        }
        rest = &rest[close..];
        n += 1;
    }
    parts.push(rest.to_string());
    parts.concat()
}

/// Each PTX mutation a GPU would run silently wrong (or hang on) fails a test here: an
/// `ld.param` offset, two registers of a vector load, two A registers of an `mma`, a
/// raised `wait_group`, a removed `bar.sync`, a `shfl` member mask. (The unmutated
/// module passes the same families in the tests above.)
#[test]
fn sm_90_mutants_each_fail() {
    let ptx = pagedkv::ptx::ALL[1].ptx;
    type Family = fn(&Arch) -> Outcome;
    let bump_offset = |l: &str| {
        let plus = l.rfind('+').unwrap();
        let close = l.rfind(']').unwrap();
        let off: u32 = l[plus + 1..close].parse().unwrap();
        format!("{}{}{}", &l[..plus + 1], off + 4, &l[close..])
    };
    let scale_at = format!(
        "param_0+{}]",
        std::mem::offset_of!(DecodeParams<F16>, scale)
    );
    let mutants: Vec<(&str, Option<String>, Family)> = vec![
        (
            "ld.param offset of `scale` +4 (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", &scale_at, bump_offset),
            decode_all,
        ),
        (
            "two registers of ld.global.nc.v4 swapped (kv_append f16)",
            mutate(ptx, "kv_append_f16", "ld.global.nc.v4.u32", |l| {
                swap_in_group(l, 0, 0, 1)
            }),
            kv_append_all,
        ),
        (
            "two A registers of an mma swapped (prefill f16)",
            mutate(ptx, "paged_prefill_attention_f16", "mma.sync", |l| {
                swap_in_group(l, 1, 0, 1)
            }),
            prefill_all,
        ),
        (
            "cp.async.wait_group raised by one (decode f16)",
            mutate(
                ptx,
                "paged_decode_attention_f16",
                "cp.async.wait_group",
                |l| {
                    let n: u32 = l
                        .trim()
                        .trim_end_matches(';')
                        .rsplit(' ')
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    l.replace(
                        &format!("wait_group {n};"),
                        &format!("wait_group {};", n + 1),
                    )
                },
            ),
            decode_all,
        ),
        (
            "a bar.sync removed (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", "bar.sync", |_| {
                String::new()
            }),
            decode_all,
        ),
        (
            "a bar.sync removed (prefill f16)",
            mutate(ptx, "paged_prefill_attention_f16", "bar.sync", |_| {
                String::new()
            }),
            prefill_all,
        ),
        (
            "shfl member mask 0x0000ffff (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", "shfl.sync", |l| {
                l.replace("0xffffffff", "0x0000ffff")
            }),
            decode_all,
        ),
    ];
    let mut survivors = Vec::new();
    for (name, text, family) in mutants {
        let text = text.unwrap_or_else(|| panic!("{name}: nothing to mutate"));
        let module = Module::parse("sm_90 (mutant)", &text).expect("a mutant still parses");
        match family(&Arch::new(module)) {
            Err(e) => eprintln!("{name}: fails as it should: {e}"),
            Ok(()) => survivors.push(name),
        }
    }
    assert!(
        survivors.is_empty(),
        "mutants no test catches: {survivors:?}"
    );
}
