//! fp8 caches through the C ABI.
//!
//! Without a GPU: `pagedkv_kv_scales_calibrate` against the crate's `KvScales::calibrate`
//! and its argument checks (outputs untouched on every error), and the argument checks
//! of `pagedkv_cuda_kv_append_fp8` / `pagedkv_cuda_decode_attention_fp8`, which check
//! the types and scales before the backend handle, so a null backend reaches them.
//!
//! With one (`cargo test -p pagedkv-capi --test c_abi -- --ignored`): the two CUDA
//! functions on device buffers against the CPU reference (`kv_append` bit-exact, decode
//! within the 16-bit tolerance of f64 attention over the dequantised cache, unsplit and
//! split-K), the plain call through the `_fp8` functions equal to the old ones, and the
//! old functions and the strided (step-path) decode refusing an fp8 dtype.

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use pagedkv::host::DType;
use pagedkv::host::ops::scales::KvScales;
use pagedkv_c::pagedkv_dtype::*;
use pagedkv_c::pagedkv_status::{self, *};
use pagedkv_c::*;

fn last_error() -> String {
    // SAFETY: never null, NUL-terminated.
    unsafe { CStr::from_ptr(pagedkv_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts a status and that the last-error message contains `msg`.
#[track_caller]
fn expect(got: pagedkv_status, want: pagedkv_status, msg: &str) {
    let e = last_error();
    assert_eq!(got, want, "{e}");
    assert!(e.contains(msg), "{e:?} does not contain {msg:?}");
}

/// Deterministic values in [-1, 1) (xorshift), scaled per KV head by `head_amp`.
fn sample(seed: u64, rows: usize, heads: usize, dim: usize, head_amp: &[f64]) -> Vec<f64> {
    let mut s = seed | 1;
    (0..rows * heads * dim)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            u * head_amp[i / dim % heads]
        })
        .collect()
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&x| x as f32).collect()
}

#[test]
fn calibrate_matches_the_crate_per_head_and_zero_heads_get_1() {
    let (heads, dim, tokens) = (3u32, 64u32, 5u64);
    // Head 1 large, head 2 all zeros.
    let k = f32s(&sample(1, 5, 3, 64, &[1.0, 300.0, 0.0]));
    let v = f32s(&sample(2, 5, 3, 64, &[0.5, 2.0, 0.0]));
    for (code, dt) in [(PAGEDKV_E4M3, DType::E4m3), (PAGEDKV_E5M2, DType::E5m2)] {
        let (mut ok, mut ov) = (vec![-7f32; 3], vec![-7f32; 3]);
        // SAFETY: each pointer is valid for its length.
        let st = unsafe {
            pagedkv_kv_scales_calibrate(
                code as i32,
                heads,
                dim,
                k.as_ptr(),
                v.as_ptr(),
                tokens,
                ok.as_mut_ptr(),
                ov.as_mut_ptr(),
            )
        };
        expect(st, PAGEDKV_OK, "");
        let f64s = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let want = KvScales::calibrate(dt, heads, dim, &f64s(&k), &f64s(&v)).unwrap();
        assert_eq!((ok.clone(), ov.clone()), (want.k, want.v), "{dt}");
        assert_eq!((ok[2], ov[2]), (1.0, 1.0));
        assert!(ok[1] > 200.0 / dt.max_finite() && ok[1] <= 300.0 / dt.max_finite());
    }
}

#[test]
fn calibrate_refuses_bad_arguments_and_leaves_the_outputs_alone() {
    let k = vec![1f32; 2 * 64];
    let mut nan = k.clone();
    nan[70] = f32::NAN;
    let (mut ok, mut ov) = ([-7f32; 2], [-7f32; 2]);
    let (pk, pv) = (ok.as_mut_ptr(), ov.as_mut_ptr());
    let e4m3 = PAGEDKV_E4M3 as i32;
    type Case<'a> = (i32, u32, *const f32, *const f32, u64, *mut f32, *mut f32);
    let cases: [(Case, pagedkv_status, &str); 10] = [
        (
            (e4m3, 2, null(), k.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_NULL,
            "keys is null",
        ),
        (
            (e4m3, 2, k.as_ptr(), null(), 1, pk, pv),
            PAGEDKV_ERR_NULL,
            "values is null",
        ),
        (
            (e4m3, 2, k.as_ptr(), k.as_ptr(), 1, null_mut(), pv),
            PAGEDKV_ERR_NULL,
            "out_k is null",
        ),
        (
            (e4m3, 2, k.as_ptr(), k.as_ptr(), 1, pk, null_mut()),
            PAGEDKV_ERR_NULL,
            "out_v is null",
        ),
        (
            (PAGEDKV_F16 as i32, 2, k.as_ptr(), k.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "f16 is not an fp8 type",
        ),
        (
            (5, 2, k.as_ptr(), k.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "dtype 5 (0 f16, 1 bf16, 2 f32, 3 e4m3, 4 e5m2)",
        ),
        (
            (e4m3, 2, nan.as_ptr(), k.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "element 70 is NaN",
        ),
        (
            (e4m3, 2, k.as_ptr(), nan.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "`values`",
        ),
        (
            (e4m3, 0, k.as_ptr(), k.as_ptr(), 1, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "`keys`",
        ),
        (
            (e4m3, 2, k.as_ptr(), k.as_ptr(), u64::MAX, pk, pv),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "`num_tokens`: num_tokens * num_kv_heads * head_dim",
        ),
    ];
    for ((dt, heads, keys, values, n, out_k, out_v), want, msg) in cases {
        // SAFETY: every non-null pointer is valid for `n` rows of [heads, 64] (or the
        // call refuses the count before reading), outputs for `heads` writes.
        let st =
            unsafe { pagedkv_kv_scales_calibrate(dt, heads, 64, keys, values, n, out_k, out_v) };
        expect(st, want, msg);
        // SAFETY: the arrays live; read through the same pointers the calls got.
        assert_eq!(
            unsafe { (*pk, *pk.add(1), *pv, *pv.add(1)) },
            (-7.0, -7.0, -7.0, -7.0)
        );
    }
}

/// A decode shape: 2 sequences, 4 query heads over 2 KV heads, head_dim 64.
fn shape() -> pagedkv_decode_shape {
    pagedkv_decode_shape {
        num_seqs: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: 4,
        max_blocks_per_seq: 2,
        reserved: 0,
    }
}

/// Calls both fp8 CUDA functions on a null backend with these types and scales; the
/// device pointers are never used (nothing can launch without a backend).
fn both_fp8_calls(dtype: i32, cache: i32, scales: *const pagedkv_kv_scales) -> [pagedkv_status; 2] {
    let sh = shape();
    let (bt, cl, slots) = ([0i32, 1, 2, 3], [20i32, 5], [0i64, 17]);
    // SAFETY: the host arrays are valid for their lengths, `scales` as the caller made
    // it; the device pointers are not dereferenced on these paths.
    unsafe {
        let a = pagedkv_cuda_kv_append_fp8(
            null_mut(),
            4,
            2,
            16,
            64,
            dtype,
            cache,
            scales,
            256,
            512,
            2,
            slots.as_ptr(),
            768,
            1024,
        );
        let d = pagedkv_cuda_decode_attention_fp8(
            null_mut(),
            &sh,
            dtype,
            cache,
            scales,
            0.125,
            256,
            768,
            1024,
            bt.as_ptr(),
            4,
            cl.as_ptr(),
            2,
            512,
        );
        [a, d]
    }
}

#[test]
fn the_fp8_cuda_functions_check_types_and_scales_before_the_backend() {
    let (f16, bf16, f32_, e4m3, e5m2) = (
        PAGEDKV_F16 as i32,
        PAGEDKV_BF16 as i32,
        PAGEDKV_F32 as i32,
        PAGEDKV_E4M3 as i32,
        PAGEDKV_E5M2 as i32,
    );
    let one = [1f32, 0.5];
    let good = pagedkv_kv_scales {
        k: one.as_ptr(),
        v: one.as_ptr(),
        len: 2,
    };
    let null_k = pagedkv_kv_scales { k: null(), ..good };
    let null_v = pagedkv_kv_scales { v: null(), ..good };
    let short = pagedkv_kv_scales { len: 1, ..good };
    let long = pagedkv_kv_scales { len: 3, ..good };
    let cases: Vec<(i32, i32, *const pagedkv_kv_scales, pagedkv_status, &str)> = vec![
        // Every good pairing gets as far as the backend.
        (f16, e4m3, &good, PAGEDKV_ERR_NULL, "backend is null"),
        (bf16, e5m2, &good, PAGEDKV_ERR_NULL, "backend is null"),
        (f16, f16, null(), PAGEDKV_ERR_NULL, "backend is null"),
        (f32_, f32_, null(), PAGEDKV_ERR_NULL, "backend is null"),
        // Missing scales for an fp8 cache.
        (
            f16,
            e4m3,
            null(),
            PAGEDKV_ERR_NULL,
            "scales is null: an e4m3 cache needs",
        ),
        (f16, e4m3, &null_k, PAGEDKV_ERR_NULL, "scales.k is null"),
        (bf16, e5m2, &null_v, PAGEDKV_ERR_NULL, "scales.v is null"),
        // Bad pairs.
        (
            f32_,
            e4m3,
            &good,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "an fp8 cache serves f16 or bf16 queries, not f32",
        ),
        (
            e4m3,
            e4m3,
            &good,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "e4m3 is a cache type only",
        ),
        (
            e5m2,
            f16,
            null(),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "e5m2 is a cache type only",
        ),
        (
            f16,
            f16,
            &good,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "only fp8 caches are scaled",
        ),
        // (Not read for an unscaled cache: the pair is what is wrong.)
        (
            bf16,
            bf16,
            &null_k,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "only fp8 caches are scaled",
        ),
        (
            f16,
            bf16,
            null(),
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "dtype f16 but the cache is bf16",
        ),
        (
            7,
            e4m3,
            &good,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "dtype 7 (0 f16",
        ),
        (
            f16,
            -1,
            &good,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "dtype -1 (0 f16",
        ),
        // Scales of the wrong length (checked before the arrays are read).
        (
            f16,
            e4m3,
            &short,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "`scales.len`: 1 elements, expected 2",
        ),
        (
            f16,
            e4m3,
            &long,
            PAGEDKV_ERR_INVALID_ARGUMENT,
            "`scales.len`: 3 elements, expected 2",
        ),
    ];
    for (dt, cache, sc, want, msg) in cases {
        for st in both_fp8_calls(dt, cache, sc) {
            expect(st, want, msg);
        }
    }
    // Scales that are not finite and positive, in K or in V.
    for x in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY] {
        let (fine, wrong) = ([1f32, 1.0], [1f32, x]);
        for (k, v, arg) in [(wrong, fine, "kv_scales.k"), (fine, wrong, "kv_scales.v")] {
            let s = pagedkv_kv_scales {
                k: k.as_ptr(),
                v: v.as_ptr(),
                len: 2,
            };
            for st in both_fp8_calls(f16, e4m3, &s) {
                expect(st, PAGEDKV_ERR_INVALID_ARGUMENT, arg);
                let e = last_error();
                assert!(
                    e.contains("KV head 1") && e.contains("must be finite and > 0"),
                    "{e}"
                );
            }
        }
    }
    // A null shape is refused before the types are read.
    // SAFETY: null shape; nothing else is read.
    let st = unsafe {
        pagedkv_cuda_decode_attention_fp8(
            null_mut(),
            null(),
            f16,
            e4m3,
            &good,
            1.0,
            0,
            0,
            0,
            null(),
            0,
            null(),
            0,
            0,
        )
    };
    expect(st, PAGEDKV_ERR_NULL, "shape is null");
}

/// The GPU half: device buffers made with the crate's backend, the C handle on its
/// stream so the uploads, the C calls and the downloads are ordered.
mod gpu {
    use std::ffi::c_void;
    use std::ptr::{null, null_mut};

    use cudarc::driver::{CudaSlice, DevicePtr};
    use pagedkv::cuda::{CudaDevice, DeviceTensor, device};
    use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
    use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
    use pagedkv::host::ops::scales::KvScales;
    use pagedkv::host::reference::paged_decode_attention;
    use pagedkv::host::{DType, HostTensor};
    use pagedkv::kernels::PagedLayout;
    use pagedkv_c::pagedkv_status::*;
    use pagedkv_c::*;

    use super::{expect, f32s, last_error, sample};

    struct Gpu {
        rs: CudaDevice,
        c: *mut pagedkv_cuda_backend,
    }

    /// A device copy of a host tensor.
    struct Buf {
        s: CudaSlice<u8>,
        dtype: DType,
        shape: Vec<usize>,
    }

    impl Gpu {
        fn new() -> Self {
            let rs = device(0).expect("this test needs an NVIDIA GPU");
            let mut c = null_mut();
            // SAFETY: the backend's own stream, which outlives the handle (destroyed
            // first, in `drop`).
            let st = unsafe {
                pagedkv_cuda_backend_create_on_stream(
                    0,
                    rs.stream().cu_stream() as *mut c_void,
                    &mut c,
                )
            };
            expect(st, PAGEDKV_OK, "");
            Gpu { rs, c }
        }

        fn upload(&self, t: &HostTensor) -> Buf {
            Buf {
                s: DeviceTensor::from_host(&self.rs, t)
                    .unwrap()
                    .into_cuda_slice(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            }
        }

        fn addr(&self, b: &Buf) -> u64 {
            b.s.device_ptr(self.rs.stream()).0
        }

        fn download(&self, b: Buf) -> HostTensor {
            // SAFETY: a live handle.
            expect(unsafe { pagedkv_cuda_synchronize(self.c) }, PAGEDKV_OK, "");
            DeviceTensor::from_cuda_slice(b.s, b.dtype, &b.shape)
                .unwrap()
                .to_host(&self.rs)
                .unwrap()
        }
    }

    impl Drop for Gpu {
        fn drop(&mut self) {
            // SAFETY: created in `new`, destroyed once.
            let st = unsafe { pagedkv_cuda_backend_destroy(self.c) };
            if !std::thread::panicking() {
                expect(st, PAGEDKV_OK, "");
            }
        }
    }

    fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }

    fn c_dtype(d: DType) -> i32 {
        match d {
            DType::F16 => pagedkv_dtype::PAGEDKV_F16 as i32,
            DType::Bf16 => pagedkv_dtype::PAGEDKV_BF16 as i32,
            DType::F32 => pagedkv_dtype::PAGEDKV_F32 as i32,
            DType::E4m3 => pagedkv_dtype::PAGEDKV_E4M3 as i32,
            DType::E5m2 => pagedkv_dtype::PAGEDKV_E5M2 as i32,
        }
    }

    fn c_scales(s: &KvScales) -> pagedkv_kv_scales {
        pagedkv_kv_scales {
            k: s.k.as_ptr(),
            v: s.v.as_ptr(),
            len: s.k.len() as u64,
        }
    }

    const QS: [DType; 2] = [DType::F16, DType::Bf16];

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn kv_append_fp8_is_bit_exact_with_the_reference() {
        let g = Gpu::new();
        let l = PagedLayout {
            num_blocks: 6,
            num_kv_heads: 2,
            block_size: 16,
            head_dim: 128,
        };
        let (n, pool) = (40usize, l.pool_elems() as usize);
        // Distinct slots spread over the pool; token 3 is padding.
        let mut slots: Vec<i64> = (0..n as i64).map(|i| i * 37 % 96).collect();
        slots[3] = -1;
        for q in QS {
            for cache in DType::FP8 {
                let amp = [1.0, 60.0];
                let k =
                    HostTensor::from_f64(q, &[n, 2, 128], &sample(11, n, 2, 128, &amp)).unwrap();
                let v =
                    HostTensor::from_f64(q, &[n, 2, 128], &sample(12, n, 2, 128, &amp)).unwrap();
                // Scales from the C calibration, head 0's K scale shrunk so that some
                // elements saturate.
                let (mut ks, mut vs) = (vec![0f32; 2], vec![0f32; 2]);
                let (kf, vf) = (f32s(&k.to_f64()), f32s(&v.to_f64()));
                // SAFETY: each pointer valid for its length.
                let st = unsafe {
                    pagedkv_kv_scales_calibrate(
                        c_dtype(cache),
                        2,
                        128,
                        kf.as_ptr(),
                        vf.as_ptr(),
                        n as u64,
                        ks.as_mut_ptr(),
                        vs.as_mut_ptr(),
                    )
                };
                expect(st, PAGEDKV_OK, "");
                ks[0] *= 0.25;
                let scales = KvScales { k: ks, v: vs };
                let (mut kr, mut vr) = (
                    HostTensor::full(cache, &[pool], f64::NAN),
                    HostTensor::full(cache, &[pool], f64::NAN),
                );
                let (dk, dv, dkc, dvc) = (g.upload(&k), g.upload(&v), g.upload(&kr), g.upload(&vr));
                kv_append_reference(KvAppendInputs {
                    layout: &l,
                    key: &k,
                    value: &v,
                    slot_mapping: &slots,
                    key_cache: &mut kr,
                    value_cache: &mut vr,
                    scales: Some(&scales),
                })
                .unwrap();
                let sc = c_scales(&scales);
                // SAFETY: device buffers of the shapes' sizes, host arrays of their lengths.
                let st = unsafe {
                    pagedkv_cuda_kv_append_fp8(
                        g.c,
                        6,
                        2,
                        16,
                        128,
                        c_dtype(q),
                        c_dtype(cache),
                        &sc,
                        g.addr(&dk),
                        g.addr(&dv),
                        n as u64,
                        slots.as_ptr(),
                        g.addr(&dkc),
                        g.addr(&dvc),
                    )
                };
                expect(st, PAGEDKV_OK, "");
                let (kg, vg) = (g.download(dkc), g.download(dvc));
                assert!(
                    kg.buf().as_bytes() == kr.buf().as_bytes(),
                    "{q} over {cache}: K"
                );
                assert!(
                    vg.buf().as_bytes() == vr.buf().as_bytes(),
                    "{q} over {cache}: V"
                );
            }
        }
    }

    /// A pool of `cache` whose KV head `h` holds values up to `amp[h]`, stored with
    /// scales `amp / max_finite`; the scales.
    fn fp8_pool(l: &PagedLayout, cache: DType, amp: &[f64], seed: u64) -> (HostTensor, Vec<f32>) {
        let s: Vec<f32> = amp
            .iter()
            .map(|a| (a / cache.max_finite() as f64) as f32)
            .collect();
        let per_head = (l.block_size * l.head_dim) as usize;
        let blocks = l.num_blocks as usize;
        let x = sample(seed, blocks, l.num_kv_heads as usize, per_head, amp);
        let stored: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, x)| x / s[i / per_head % amp.len()] as f64)
            .collect();
        (
            HostTensor::from_f64(cache, &[stored.len()], &stored).unwrap(),
            s,
        )
    }

    /// Decode through `pagedkv_cuda_decode_attention_fp8` against f64 attention over
    /// the dequantised cache: `lens` sequences, 8 query heads over 2 KV heads.
    fn decode_case(g: &Gpu, q: DType, cache: DType, lens: &[i32]) {
        let (kvh, qh, d, bs) = (2u32, 8u32, 128u32, 16u32);
        let w = lens.iter().map(|&n| (n as u32).div_ceil(bs)).max().unwrap();
        let num_blocks = w * lens.len() as u32 + 1;
        let sh = DecodeShape {
            num_seqs: lens.len() as u32,
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            num_blocks,
            max_blocks_per_seq: w,
        };
        let l = sh.layout();
        // Tables: every block once, scattered (block 0 pads).
        let tables: Vec<i32> = (0..lens.len() as u32 * w)
            .map(|i| (i * 7919 % (num_blocks - 1) + 1) as i32)
            .collect();
        let (kc, ks) = fp8_pool(&l, cache, &[2.0, 30.0], 21);
        let (vc, vs) = fp8_pool(&l, cache, &[1.0, 8.0], 22);
        let n = lens.len() * (qh * d) as usize;
        let qt = HostTensor::from_f64(q, &[n], &sample(23, n / d as usize, 1, d as usize, &[2.0]))
            .unwrap();
        let opts = AttentionOptions::new(d);
        let scales = KvScales { k: ks, v: vs };
        let want = paged_decode_attention(&DecodeInputs {
            shape: &sh,
            opts: &opts,
            q: &qt,
            key_cache: &kc,
            value_cache: &vc,
            block_tables: &tables,
            context_lens: lens,
            plan: None,
            kv_scales: Some(&scales),
            sinks: None,
        });
        let out = HostTensor::full(q, &[n], f64::NAN);
        let (dq, dkc, dvc, dout) = (g.upload(&qt), g.upload(&kc), g.upload(&vc), g.upload(&out));
        let csh = pagedkv_decode_shape {
            num_seqs: sh.num_seqs,
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            num_blocks,
            max_blocks_per_seq: w,
            reserved: 0,
        };
        let sc = c_scales(&scales);
        // SAFETY: device buffers of the shapes' sizes, host arrays of their lengths.
        let st = unsafe {
            pagedkv_cuda_decode_attention_fp8(
                g.c,
                &csh,
                c_dtype(q),
                c_dtype(cache),
                &sc,
                opts.scale,
                g.addr(&dq),
                g.addr(&dkc),
                g.addr(&dvc),
                tables.as_ptr(),
                tables.len() as u64,
                lens.as_ptr(),
                lens.len() as u64,
                g.addr(&dout),
            )
        };
        expect(st, PAGEDKV_OK, "");
        let got = g.download(dout).to_f64();
        let e = rel_l2(&got, &want);
        assert!(e <= 1e-2, "{q} over {cache}, lens {lens:?}: rel L2 {e:e}");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn decode_attention_fp8_matches_the_dequantised_reference() {
        let g = Gpu::new();
        for q in QS {
            for cache in DType::FP8 {
                // A batch of short and odd lengths, and one long sequence (split-K on a
                // GPU with many SMs).
                decode_case(&g, q, cache, &[1, 37, 300]);
                decode_case(&g, q, cache, &[4096]);
            }
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn the_fp8_functions_with_one_type_are_the_plain_calls() {
        let g = Gpu::new();
        let sh = pagedkv_decode_shape {
            num_seqs: 2,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            num_blocks: 5,
            max_blocks_per_seq: 2,
            reserved: 0,
        };
        let pool = 5 * 2 * 16 * 64;
        let (tables, lens, slots) = ([1i32, 2, 3, 4], [20i32, 31], [16i64, 63]);
        let kv = |seed| {
            HostTensor::from_f64(
                DType::F16,
                &[2, 2, 64],
                &sample(seed, 2, 2, 64, &[1.0, 1.0]),
            )
            .unwrap()
        };
        let cache = |seed| {
            HostTensor::from_f64(DType::F16, &[pool], &sample(seed, 1, 1, pool, &[1.0])).unwrap()
        };
        let q = HostTensor::from_f64(DType::F16, &[512], &sample(5, 1, 1, 512, &[1.0])).unwrap();
        let (dk, dv, dq) = (g.upload(&kv(1)), g.upload(&kv(2)), g.upload(&q));
        let f16 = pagedkv_dtype::PAGEDKV_F16 as i32;
        let mut outs = Vec::new();
        for fp8_api in [false, true] {
            let (dkc, dvc) = (g.upload(&cache(3)), g.upload(&cache(4)));
            let dout = g.upload(&HostTensor::full(DType::F16, &[512], f64::NAN));
            let (a, b, c, o) = (g.addr(&dkc), g.addr(&dvc), g.addr(&dq), g.addr(&dout));
            // SAFETY: device buffers of the shapes' sizes, host arrays of their lengths.
            let st = unsafe {
                if fp8_api {
                    [
                        pagedkv_cuda_kv_append_fp8(
                            g.c,
                            5,
                            2,
                            16,
                            64,
                            f16,
                            f16,
                            null(),
                            g.addr(&dk),
                            g.addr(&dv),
                            2,
                            slots.as_ptr(),
                            a,
                            b,
                        ),
                        pagedkv_cuda_decode_attention_fp8(
                            g.c,
                            &sh,
                            f16,
                            f16,
                            null(),
                            0.125,
                            c,
                            a,
                            b,
                            tables.as_ptr(),
                            4,
                            lens.as_ptr(),
                            2,
                            o,
                        ),
                    ]
                } else {
                    [
                        pagedkv_cuda_kv_append(
                            g.c,
                            5,
                            2,
                            16,
                            64,
                            f16,
                            g.addr(&dk),
                            g.addr(&dv),
                            2,
                            slots.as_ptr(),
                            a,
                            b,
                        ),
                        pagedkv_cuda_decode_attention(
                            g.c,
                            &sh,
                            f16,
                            0.125,
                            c,
                            a,
                            b,
                            tables.as_ptr(),
                            4,
                            lens.as_ptr(),
                            2,
                            o,
                        ),
                    ]
                }
            };
            for s in st {
                expect(s, PAGEDKV_OK, "");
            }
            outs.push((g.download(dkc), g.download(dvc), g.download(dout)));
        }
        let bytes = |t: &HostTensor| t.buf().as_bytes().to_vec();
        let [(k0, v0, o0), (k1, v1, o1)] =
            [&outs[0], &outs[1]].map(|(k, v, o)| (bytes(k), bytes(v), bytes(o)));
        assert!(k0 == k1 && v0 == v1 && o0 == o1);
        assert!(o0.chunks(2).all(|h| !f16_is_nan(h)), "out fully written");
    }

    fn f16_is_nan(h: &[u8]) -> bool {
        let x = u16::from_le_bytes([h[0], h[1]]);
        x & 0x7c00 == 0x7c00 && x & 0x03ff != 0
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn the_one_type_functions_refuse_an_fp8_dtype_with_a_live_backend() {
        let g = Gpu::new();
        let sh = pagedkv_decode_shape {
            num_seqs: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 64,
            block_size: 16,
            num_blocks: 1,
            max_blocks_per_seq: 1,
            reserved: 0,
        };
        let (bt, cl, slots) = ([0i32], [1i32], [0i64]);
        let buf = g.upload(&HostTensor::full(DType::F32, &[1024], 0.0));
        let p = g.addr(&buf);
        for dt in [pagedkv_dtype::PAGEDKV_E4M3, pagedkv_dtype::PAGEDKV_E5M2] {
            let dt = dt as i32;
            // SAFETY: a live handle; the calls refuse the dtype before using a pointer.
            let st = unsafe {
                [
                    pagedkv_cuda_kv_append(g.c, 1, 1, 16, 64, dt, p, p, 1, slots.as_ptr(), p, p),
                    pagedkv_cuda_decode_attention(
                        g.c,
                        &sh,
                        dt,
                        1.0,
                        p,
                        p,
                        p,
                        bt.as_ptr(),
                        1,
                        cl.as_ptr(),
                        1,
                        p,
                    ),
                    pagedkv_cuda_decode_attention_strided(
                        g.c,
                        &sh,
                        dt,
                        1.0,
                        p,
                        0,
                        p,
                        p,
                        bt.as_ptr(),
                        1,
                        cl.as_ptr(),
                        1,
                        p,
                        0,
                    ),
                ]
            };
            for s in st {
                expect(s, PAGEDKV_ERR_INVALID_ARGUMENT, "is a cache type only");
                assert!(
                    last_error().contains("pagedkv_cuda_decode_attention_fp8"),
                    "{}",
                    last_error()
                );
            }
        }
        drop(buf);
    }
}
