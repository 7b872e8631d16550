//! The embedded PTX matches the kernels: every `Kernel::NAME` is an entry point of
//! every module, and the modules are the architectures docs/kernels.md promises.

use pagedkv::kernels::kernels::{
    CopyBlocks, DecodeReduce, KvAppend, MergeStates, PagedDecode, PagedPrefill, PagedPrefillSimt,
};
use pagedkv::kernels::{Bf16, E4m3, E5m2, F16, Kernel};
use pagedkv::ptx;

fn names() -> Vec<&'static str> {
    macro_rules! typed {
        ($t:ty) => {
            [
                <KvAppend<$t> as Kernel>::NAME,
                <PagedDecode<$t> as Kernel>::NAME,
                <PagedDecode<$t, $t, 64> as Kernel>::NAME,
                <PagedDecode<$t, $t, 128> as Kernel>::NAME,
                <PagedDecode<$t, $t, 256> as Kernel>::NAME,
                <DecodeReduce<$t> as Kernel>::NAME,
                <MergeStates<$t> as Kernel>::NAME,
            ]
        };
    }
    let mut v = vec![<CopyBlocks as Kernel>::NAME];
    v.extend(typed!(F16));
    v.extend(typed!(Bf16));
    v.extend(typed!(f32));
    v.extend([
        <PagedPrefill<F16> as Kernel>::NAME,
        <PagedPrefill<F16, F16, 0, true> as Kernel>::NAME,
        <PagedPrefill<F16, F16, 64> as Kernel>::NAME,
        <PagedPrefill<F16, F16, 128> as Kernel>::NAME,
        <PagedPrefill<Bf16> as Kernel>::NAME,
        <PagedPrefill<Bf16, Bf16, 0, true> as Kernel>::NAME,
        <PagedPrefill<Bf16, Bf16, 64> as Kernel>::NAME,
        <PagedPrefill<Bf16, Bf16, 128> as Kernel>::NAME,
        <PagedPrefillSimt<f32> as Kernel>::NAME,
    ]);
    // fp8 caches under f16 / bf16 queries.
    macro_rules! fp8 {
        ($t:ty, $k:ty) => {
            [
                <KvAppend<$t, $k> as Kernel>::NAME,
                <PagedDecode<$t, $k> as Kernel>::NAME,
                <PagedDecode<$t, $k, 64> as Kernel>::NAME,
                <PagedDecode<$t, $k, 128> as Kernel>::NAME,
                <PagedDecode<$t, $k, 256> as Kernel>::NAME,
                <PagedPrefill<$t, $k> as Kernel>::NAME,
                <PagedPrefill<$t, $k, 0, true> as Kernel>::NAME,
                <PagedPrefill<$t, $k, 64> as Kernel>::NAME,
                <PagedPrefill<$t, $k, 128> as Kernel>::NAME,
            ]
        };
    }
    v.extend(fp8!(F16, E4m3));
    v.extend(fp8!(F16, E5m2));
    v.extend(fp8!(Bf16, E4m3));
    v.extend(fp8!(Bf16, E5m2));
    v
}

#[test]
fn every_kernel_is_an_entry_point_of_every_module() {
    let archs: Vec<_> = ptx::ALL.iter().map(|m| m.arch).collect();
    assert_eq!(archs, ["sm_80", "sm_90"]);
    for m in ptx::ALL {
        assert!(m.ptx.contains(&format!(".target {}", m.arch)));
        let mut want = names();
        want.sort();
        let mut got = m.entry_points.to_vec();
        got.sort();
        assert_eq!(got, want, "{}", m.arch);
    }
}

#[test]
fn the_newest_module_a_device_can_run_is_chosen() {
    assert_eq!(ptx::for_compute_capability(7, 5), None);
    assert_eq!(ptx::for_compute_capability(8, 0).unwrap().arch, "sm_80");
    assert_eq!(ptx::for_compute_capability(8, 9).unwrap().arch, "sm_80");
    assert_eq!(ptx::for_compute_capability(9, 0).unwrap().arch, "sm_90");
    assert_eq!(ptx::for_compute_capability(12, 0).unwrap().arch, "sm_90");
}

#[test]
fn hot_loads_are_global_and_sixteen_bytes_wide() {
    for m in ptx::ALL {
        // K and V are read through the non-coherent global path, 16 bytes at a time.
        assert!(m.ptx.contains("ld.global.nc.v4.u32"), "{}", m.arch);
        assert!(m.ptx.contains("st.global.v4.u32"), "{}", m.arch);
        // No local memory anywhere (no spilled arrays).
        assert!(
            !m.ptx.contains(".local"),
            "{}: local memory in the PTX",
            m.arch
        );
    }
}

/// The text of entry point `name` in `ptx` (up to the next entry).
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry {name}"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(rest.len(), |e| e);
    &rest[..end]
}

#[test]
fn decode_streams_k_and_v_through_the_cp_async_pipeline() {
    for m in ptx::ALL {
        for t in ["f16", "bf16", "f32"] {
            for suffix in ["", "_d64", "_d128", "_d256"] {
                let name = format!("paged_decode_attention_{t}{suffix}");
                let body = entry_body(m.ptx, &name);
                let wants: Vec<String> = if tensor_core_decode(&name) {
                    vec![
                        format!("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"),
                        "ldmatrix.sync.aligned.m8n8.x4.shared.b16".into(),
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16".into(),
                        "cp.async.wait_group 1".into(),
                    ]
                } else {
                    vec![
                        "cp.async.wait_group 2".into(),
                        "ld.shared.v4.u32".into(),
                        "fma.rn.f32".into(),
                    ]
                };
                for want in wants.iter().map(String::as_str).chain([
                    "cp.async.cg.shared.global",
                    "cp.async.commit_group",
                    "ex2.approx.ftz.f32",
                ]) {
                    assert!(body.contains(want), "{} {name}: no `{want}`", m.arch);
                }
                // K and V come only through cp.async: no 16-byte global load is left.
                assert!(
                    !body.contains("ld.global.nc.v4"),
                    "{} {name}: K/V read with a plain global load",
                    m.arch
                );
                // No stack frame: every fragment and capture stays in registers.
                assert!(!body.contains(".local"), "{} {name}: a stack frame", m.arch);
            }
        }
    }
}

/// Whether decode entry point `name` is a tensor-core kernel: q of f16 or bf16 (any
/// cache: the same, or fp8) at a head_dim of `MMA_HEAD_DIMS`, as the host's
/// `decode_kernel`.
pub(crate) fn tensor_core_decode(name: &str) -> bool {
    use pagedkv::kernels::kernels::attention::MMA_HEAD_DIMS;
    let rest = name.trim_start_matches("paged_decode_attention_");
    let mut parts = rest.split('_');
    let q = parts.next().unwrap_or("");
    let tail: Vec<&str> = parts.collect();
    let d = match tail.as_slice() {
        [d] | ["e4m3" | "e5m2", d] => *d,
        _ => return false,
    };
    matches!(q, "f16" | "bf16") && MMA_HEAD_DIMS.iter().any(|h| d == format!("d{h}"))
}

#[test]
fn fp8_decode_runs_on_tensor_cores_decoding_two_bytes_per_cvt_on_sm_90() {
    for m in ptx::ALL {
        for t in ["f16", "bf16"] {
            for k in ["e4m3", "e5m2"] {
                for d in ["_d64", "_d128"] {
                    let name = format!("paged_decode_attention_{t}_{k}{d}");
                    assert!(tensor_core_decode(&name), "{name}");
                    let body = entry_body(m.ptx, &name);
                    let mut wants = vec![
                        format!("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"),
                        "cp.async.cg.shared.global".into(),
                        "cp.async.wait_group 1".into(),
                        // K: 16 bytes a lane per row; V: 4 bytes of 4 rows.
                        "ld.shared.v4.u32".into(),
                        "ld.shared.u32".into(),
                    ];
                    if m.arch == "sm_90" {
                        wants.push(format!("cvt.rn.f16x2.{k}x2"));
                    }
                    for want in &wants {
                        assert!(
                            body.contains(want.as_str()),
                            "{} {name}: no `{want}`",
                            m.arch
                        );
                    }
                    assert!(
                        !body.contains("ldmatrix"),
                        "{} {name}: ldmatrix of fp8",
                        m.arch
                    );
                    assert!(!body.contains(".local"), "{} {name}: a stack frame", m.arch);
                }
            }
        }
    }
}

#[test]
fn prefill_runs_on_tensor_cores_with_k_and_v_through_cp_async() {
    for m in ptx::ALL {
        for t in ["f16", "bf16"] {
            let name = format!("paged_prefill_attention_{t}");
            let body = entry_body(m.ptx, &name);
            for want in [
                format!("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"),
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16".into(),
                "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16".into(),
                "cp.async.cg.shared.global".into(),
                "ex2.approx.ftz.f32".into(),
            ] {
                assert!(body.contains(&want), "{} {name}: no `{want}`", m.arch);
            }
        }
    }
}

#[test]
fn the_planners_register_count_bounds_every_decode_kernel() {
    use pagedkv::host::ops::attention::{
        Arch, DECODE_REGISTERS, DECODE_REGISTERS_FP8, DECODE_REGISTERS_MMA,
        DECODE_REGISTERS_MMA_FP8,
    };
    let report = include_str!("../../ptx/resources.md");
    // The ptxas table comes first; the SASS and occupancy tables follow it.
    let ptxas = report.split("\n## ").next().unwrap();
    let mut seen = 0;
    for line in ptxas
        .lines()
        .filter(|l| l.contains("paged_decode_attention"))
    {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        let regs: u32 = cols[3].parse().unwrap();
        let fp8 = cols[2].contains("_e4m3") || cols[2].contains("_e5m2");
        let bound = if tensor_core_decode(cols[2]) {
            if fp8 {
                DECODE_REGISTERS_MMA_FP8
            } else {
                DECODE_REGISTERS_MMA
            }
        } else if fp8 {
            DECODE_REGISTERS_FP8
        } else {
            DECODE_REGISTERS
        };
        assert!(
            regs <= bound,
            "{} {}: {regs} registers > the planner's bound {bound}: occupancy would be overestimated",
            cols[1],
            cols[2]
        );
        // And the architecture's own bound, which the planner uses on that GPU.
        let arch = Arch::from_name(cols[1]).expect("a shipped architecture");
        let own = arch.decode_registers(tensor_core_decode(cols[2]), fp8);
        assert!(
            regs <= own,
            "{} {}: {regs} registers > {arch:?}'s bound {own}: occupancy would be overestimated",
            cols[1],
            cols[2]
        );
        seen += 1;
    }
    // 28 decode kernels (7 type pairs x 4 geometries) on each of 2 architectures.
    assert_eq!(seen, 56, "decode rows in ptx/resources.md");
}

/// `(offset, bytes)` of every scalar field of a params struct, `PagedLayout`'s four
/// fields expanded.
fn fields(list: &[(usize, usize)], layout_at: Option<usize>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = list.iter().map(|&(o, n)| (o as u64, n as u64)).collect();
    if let Some(l) = layout_at {
        v.extend((0..4).map(|i| ((l + 4 * i) as u64, 4)));
    }
    v.sort_unstable();
    v
}

/// Every entry point's `.param` is the host struct's size and alignment, and every
/// `ld.param` in it loads whole fields of that struct (it starts at a field and ends at
/// one: never padding, never half a field), read from the PTX by the interpreter's
/// parser and compared with `offset_of!` on the host side.
#[test]
fn every_param_load_reads_whole_fields_of_the_host_struct() {
    use pagedkv::kernels::kernels::{
        CopyBlocksParams, DecodeParams, KvAppendParams, MergeParams, PrefillParams, ReduceParams,
    };
    use std::mem::{align_of, offset_of, size_of};
    macro_rules! f {
        ($t:ty: $($field:ident: $n:expr),*) => {
            &[$((offset_of!($t, $field), $n)),*]
        };
    }
    type D = DecodeParams<F16>;
    type P = PrefillParams<F16>;
    type A = KvAppendParams<F16>;
    type R = ReduceParams<F16>;
    type M = MergeParams<F16>;
    /// Entry-point prefix, size, alignment, fields.
    type Struct = (&'static str, u64, u64, Vec<(u64, u64)>);
    let structs: [Struct; 6] = [
        (
            "copy_blocks",
            size_of::<CopyBlocksParams>() as u64,
            align_of::<CopyBlocksParams>() as u64,
            fields(
                f!(CopyBlocksParams: pools: 16, pairs: 16, block_bytes: 8),
                None,
            ),
        ),
        (
            "kv_append",
            size_of::<A>() as u64,
            align_of::<A>() as u64,
            fields(
                f!(A: key: 16, value: 16, slot_mapping: 16, key_cache: 16, value_cache: 16,
                   k_scales: 16, v_scales: 16),
                Some(offset_of!(A, layout)),
            ),
        ),
        (
            "paged_decode_attention",
            size_of::<D>() as u64,
            align_of::<D>() as u64,
            fields(
                f!(D: q: 16, key_cache: 16, value_cache: 16, k_scales: 16, v_scales: 16,
                   block_tables: 16, context_lens: 16, kv_start: 16, alibi_slopes: 16,
                   sinks: 16, out: 16, lse: 16, part_out: 16, part_ml: 16, num_q_heads: 4, max_blocks_per_seq: 4,
                   heads_per_block: 4, partition_tokens: 4, num_partitions: 4, scale: 4,
                   softcap: 4, inv_softcap: 4, window: 4, _pad: 4, q_row_stride: 8,
                   out_row_stride: 8),
                Some(offset_of!(D, layout)),
            ),
        ),
        (
            "paged_decode_reduce",
            size_of::<R>() as u64,
            align_of::<R>() as u64,
            fields(
                f!(R: part_out: 16, part_ml: 16, sinks: 16, out: 16, lse: 16, num_q_heads: 4,
                   head_dim: 4, num_partitions: 4, _pad: 4, out_row_stride: 8),
                None,
            ),
        ),
        (
            "merge_states",
            size_of::<M>() as u64,
            align_of::<M>() as u64,
            fields(
                f!(M: v: 16, lse: 16, state_rows: 16, sinks: 16, out: 16, lse_out: 16, num_states: 4,
                   num_heads: 4, head_dim: 4, _pad: 4, out_row_stride: 8),
                None,
            ),
        ),
        (
            "paged_prefill_attention",
            size_of::<P>() as u64,
            align_of::<P>() as u64,
            fields(
                f!(P: q: 16, key_cache: 16, value_cache: 16, k_scales: 16, v_scales: 16,
                   block_tables: 16, qo_indptr: 16, context_lens: 16, alibi_slopes: 16,
                   sinks: 16, out: 16, lse: 16, q_rows: 16, q_pos: 16, tree_mask: 16, num_q_heads: 4,
                   max_blocks_per_seq: 4, scale: 4, softcap: 4,
                   inv_softcap: 4, window: 4, q_row_stride: 8),
                Some(offset_of!(P, layout)),
            ),
        ),
    ];
    for m in ptx::ALL {
        let module = pagedkv_ptx_interp::Module::parse(m.arch, m.ptx).unwrap();
        for k in module.entry_points() {
            let (_, size, align, fields) = structs
                .iter()
                .find(|(prefix, ..)| k.starts_with(prefix))
                .unwrap_or_else(|| panic!("{k}: which params struct?"));
            assert_eq!(
                module.param_layout(k),
                Some((*size, *align)),
                "{} {k}",
                m.arch
            );
            // A view's pointer and length are fields of their own (8 bytes each).
            let mut bounds: Vec<u64> = Vec::new();
            for &(o, n) in fields {
                if n == 16 {
                    bounds.extend([o, o + 8, o + 16]);
                } else {
                    bounds.extend([o, o + n]);
                }
            }
            let loads = module.param_loads(k);
            assert!(!loads.is_empty(), "{k}");
            for (off, n) in loads {
                let (off, end) = (off as u64, off as u64 + n);
                assert!(
                    bounds.contains(&off) && bounds.contains(&end) && end <= *size,
                    "{} {k}: ld.param of {n} bytes at {off} is not whole fields",
                    m.arch
                );
            }
        }
    }
}

/// Every entry point declares `.maxntid` (added by scripts/build-ptx.sh: rustc has no
/// attribute for it) equal to the block size the host launches it with, so ptxas and
/// the driver enforce it (and the PTX interpreter refuses larger blocks).
#[test]
fn every_entry_declares_the_block_size_the_host_launches() {
    use pagedkv::host::DType;
    use pagedkv::host::ops::attention::{
        DecodeShape, SplitPlan, decode_launch_config, reduce_launch_config,
    };
    use pagedkv::host::ops::{copy_blocks, kv_append, prefill};
    let shape = DecodeShape {
        num_seqs: 1,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
        num_blocks: 4,
        max_blocks_per_seq: 4,
    };
    let plan = SplitPlan {
        heads_per_block: 4,
        partition_tokens: 64,
        num_partitions: 1,
    };
    let block = |k: &str| -> u32 {
        let cfg =
            if k == "copy_blocks" {
                copy_blocks::launch_config(1, 1)
            } else if k.starts_with("kv_append") {
                kv_append::launch_config(1)
            } else if k.starts_with("paged_decode_attention") {
                decode_launch_config(&shape, DType::F16, &plan)
            } else if k.starts_with("paged_decode_reduce") {
                reduce_launch_config(&shape, DType::F16)
            } else if k.starts_with("merge_states") {
                pagedkv::host::ops::merge::launch_config(1, 8, 128, DType::F16)
            } else if k == "paged_prefill_attention_f32" {
                prefill::PrefillKernel::Simt.launch_config(&shape, DType::F32, 16)
            } else {
                // The multi-warp kernels at their head_dim, the one-warp ones at a head_dim
                // without one.
                let head_dim = ["64", "128"]
                    .into_iter()
                    .find(|d| k.ends_with(&format!("_d{d}")))
                    .map_or(80, |d| d.parse().unwrap());
                let shape = DecodeShape { head_dim, ..shape };
                prefill::PrefillKernel::choose(&shape, DType::F16, DType::F16, u32::MAX)
                    .launch_config(&shape, DType::F16, 16)
            };
        assert_eq!((cfg.block.y, cfg.block.z), (1, 1), "{k}");
        cfg.block.x
    };
    for m in ptx::ALL {
        let module = pagedkv_ptx_interp::Module::parse(m.arch, m.ptx).unwrap();
        for k in module.entry_points() {
            assert_eq!(module.maxntid(k), Some([block(k), 1, 1]), "{} {k}", m.arch);
        }
    }
}
