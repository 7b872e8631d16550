//! The emulator's tensor-core instructions (`ldmatrix`, `mma.m16n8k16`) against a
//! scalar matrix product, with a distinct value in every element of A, B and C, so a
//! fragment element in the wrong place (a swapped row, half or register) changes D.
//! Every `ldmatrix` form is used: x4 for A; x2 with `.trans` for B stored `[k][n]` and
//! without for B stored `[n][k]`; x1 (four calls) for A as well.

use pagedkv_host::emulator::{EmuError, Emulator, LaunchConfig};
use pagedkv_kernels::device::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use pagedkv_kernels::{Ctx, Dim3, GlobalSlice, GlobalSliceMut, Kernel};

/// A 16x16 by 16x8 product on one warp.
#[derive(Clone, Copy)]
struct Params {
    /// `[16, 16]` row-major, 16-bit.
    a: GlobalSlice<u16>,
    /// `[16, 8]` (`[k][n]`) when `b_kn`, else `[8, 16]` (`[n][k]`), 16-bit.
    b: GlobalSlice<u16>,
    /// `[16, 8]` f32.
    c: GlobalSlice<f32>,
    /// `[16, 8]` f32, written.
    d: GlobalSliceMut<f32>,
    bf16: bool,
    b_kn: bool,
    a_by_x1: bool,
    _pad: [u8; 5],
}
// SAFETY: four views, three bools and 5 explicit padding bytes: 72 bytes, no padding;
// every view reported.
unsafe impl pagedkv_kernels::KernelParams for Params {
    fn globals(&self, f: &mut dyn FnMut(pagedkv_kernels::GlobalRange)) {
        f(self.a.range("a"));
        f(self.b.range("b"));
        f(self.c.range("c"));
        f(self.d.range("d"));
    }
}

/// Shared memory: A in words 0..128, B in words 128..192.
const B_WORD: u32 = 128;

struct MmaTile;
impl Kernel for MmaTile {
    type Params = Params;
    const NAME: &'static str = "mma_tile";
    fn run<C: Ctx>(ctx: &C, p: &Params) {
        let lane = ctx.lane();
        // Stage A and B into shared memory, two 16-bit elements per word.
        for w in (lane..192).step_by(32) {
            let (src, i) = if w < B_WORD {
                (&p.a, 2 * w as u64)
            } else {
                (&p.b, 2 * (w - B_WORD) as u64)
            };
            let word = ctx.ld(src, i) as u32 | (ctx.ld(src, i + 1) as u32) << 16;
            ctx.smem_st_u32(w, word);
        }
        ctx.sync_threads();
        // A: matrix m = lane / 8 holds rows 8 * (m % 2).. and columns 8 * (m / 2)..
        let a_row = |m: u32, r: u32| (r + 8 * (m % 2)) * 8 + 4 * (m / 2);
        let a = if p.a_by_x1 {
            [0, 1, 2, 3].map(|m| ctx.ldmatrix_x1::<false>(a_row(m, lane % 8)))
        } else {
            ctx.ldmatrix_x4::<false>(a_row(lane / 8, lane % 8))
        };
        // B: matrix j = lane / 8 (lanes 0-15) covers k = 8j..8j + 8.
        let (j, r) = ((lane / 8) % 2, lane % 8);
        let b = if p.b_kn {
            ctx.ldmatrix_x2::<true>(B_WORD + (8 * j + r) * 4)
        } else {
            ctx.ldmatrix_x2::<false>(B_WORD + r * 8 + 4 * j)
        };
        let (g, t) = (lane / 4, lane % 4);
        let at = |i: u32| ((g + 8 * (i / 2)) * 8 + 2 * t + i % 2) as u64;
        let c = [0, 1, 2, 3].map(|i| ctx.ld(&p.c, at(i)));
        let d = if p.bf16 {
            ctx.mma_m16n8k16_bf16(a, b, c)
        } else {
            ctx.mma_m16n8k16_f16(a, b, c)
        };
        for (i, v) in d.into_iter().enumerate() {
            ctx.st(&p.d, at(i as u32), v);
        }
    }
}

fn view<T>(v: &[T]) -> GlobalSlice<T> {
    // SAFETY: `v` outlives the launch in every test and is only read.
    unsafe { GlobalSlice::from_raw_parts(v.as_ptr(), v.len() as u64) }
}

fn run(bf16: bool, b_kn: bool, a_by_x1: bool) -> (Vec<f32>, Vec<f64>) {
    let enc = |x: f32| if bf16 { f32_to_bf16(x) } else { f32_to_f16(x) };
    let dec = |h: u16| f64::from(if bf16 { bf16_to_f32(h) } else { f16_to_f32(h) });
    // Distinct values, exact in f16 and bf16: (i - 128) / 32 and a permutation of it.
    let a: Vec<u16> = (0..256).map(|i| enc((i as f32 - 128.0) / 32.0)).collect();
    let bkn: Vec<u16> = (0..128)
        .map(|i| enc(((i * 3 % 256) as f32 - 128.0) / 16.0))
        .collect();
    let b: Vec<u16> = if b_kn {
        bkn.clone()
    } else {
        (0..128).map(|i| bkn[(i % 16) * 8 + i / 16]).collect()
    };
    let c: Vec<f32> = (0..128).map(|i| i as f32 * 0.25 - 7.0).collect();
    let mut want = vec![0f64; 128];
    for row in 0..16 {
        for col in 0..8 {
            let dot: f64 = (0..16)
                .map(|k| dec(a[row * 16 + k]) * dec(bkn[k * 8 + col]))
                .sum();
            want[row * 8 + col] = dot + f64::from(c[row * 8 + col]);
        }
    }
    let mut d = vec![f32::NAN; 128];
    let params = Params {
        a: view(&a),
        b: view(&b),
        c: view(&c),
        // SAFETY: `d` outlives the launch; each element is written by one lane.
        d: unsafe { GlobalSliceMut::from_raw_parts(d.as_mut_ptr(), 128) },
        bf16,
        b_kn,
        a_by_x1,
        _pad: [0; 5],
    };
    let cfg = LaunchConfig {
        grid: Dim3::new(1, 1, 1),
        block: Dim3::new(32, 1, 1),
        shared_bytes: 192 * 4,
    };
    // SAFETY: the views cover vectors alive for the call; one writer per element of d.
    unsafe { Emulator::new().launch::<MmaTile>(cfg, params) }.unwrap();
    (d, want)
}

#[test]
fn ldmatrix_and_mma_match_a_scalar_matrix_product_in_every_form() {
    for bf16 in [false, true] {
        for b_kn in [false, true] {
            for a_by_x1 in [false, true] {
                let (got, want) = run(bf16, b_kn, a_by_x1);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    // Products of these values are multiples of 2^-9 and their sums are
                    // exact in f32: the result must be exact.
                    assert_eq!(
                        f64::from(*g),
                        *w,
                        "bf16 {bf16} b_kn {b_kn} x1 {a_by_x1}: D[{}][{}]",
                        i / 8,
                        i % 8
                    );
                }
            }
        }
    }
}

/// Half of the warp at an `ldmatrix`, the other half at a shuffle.
struct Divergent;
impl Kernel for Divergent {
    type Params = ();
    const NAME: &'static str = "divergent";
    fn run<C: Ctx>(ctx: &C, _: &()) {
        if ctx.lane() < 16 {
            ctx.ldmatrix_x1::<false>(0);
        } else {
            ctx.shfl_xor_u32(1, 1);
        }
    }
}

/// A lane whose row is used gives a misaligned address.
struct Misaligned;
impl Kernel for Misaligned {
    type Params = ();
    const NAME: &'static str = "misaligned";
    fn run<C: Ctx>(ctx: &C, _: &()) {
        ctx.ldmatrix_x4::<false>(4 * ctx.lane() + (ctx.lane() == 5) as u32);
    }
}

#[test]
fn a_divergent_or_misaligned_ldmatrix_is_an_error() {
    let cfg = LaunchConfig {
        grid: Dim3::new(1, 1, 1),
        block: Dim3::new(32, 1, 1),
        shared_bytes: 1024,
    };
    // SAFETY: no memory views.
    let e = unsafe { Emulator::new().launch::<Divergent>(cfg, ()) }.unwrap_err();
    assert!(matches!(e, EmuError::ShuffleDivergence { .. }), "{e}");
    // SAFETY: as above.
    let e = unsafe { Emulator::new().launch::<Misaligned>(cfg, ()) }.unwrap_err();
    assert!(e.to_string().contains("not 16-byte aligned"), "{e}");
}
