//! The GPU implementation of [`Ctx`](super::Ctx): NVPTX intrinsics and inline PTX.
//!
//! Compiled for `nvptx64-nvidia-cuda` only. Every method is `#[inline(always)]` and
//! lowers to one or a few PTX instructions; the PTX under `ptx/` shows the result.
//!
//! Global loads and stores convert the generic pointer that a by-value parameter struct
//! yields into a global one (`cvta.to.global.u64`) and use `ld.global` / `st.global`
//! explicitly: left to itself LLVM emits generic `ld`, which costs an address-space
//! check on every access.

use core::arch::{asm, global_asm, nvptx};

use super::{Ctx, Dim3, GlobalSlice, GlobalSliceMut};

// The block's dynamic shared memory: its size is set at launch time.
global_asm!(".extern .shared .align 16 .b8 smem[];");

/// The GPU execution context. Zero-sized: every method reads a special register or
/// issues an instruction.
#[derive(Clone, Copy, Debug, Default)]
pub struct Gpu;

/// Stops the kernel with an error (`trap`). Used by the panic handler.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` aborts the kernel; it touches no memory.
    unsafe { nvptx::trap() }
}

#[inline(always)]
fn to_global(p: *const u8) -> u64 {
    let g: u64;
    // SAFETY: pure address-space conversion of a pointer the host vouched for.
    unsafe {
        asm!("cvta.to.global.u64 {g}, {p};", g = out(reg64) g, p = in(reg64) p as u64,
             options(pure, nomem, nostack));
    }
    g
}

#[inline(always)]
fn smem_base() -> u64 {
    let a: u64;
    // SAFETY: takes the address of the `smem` symbol in the shared window.
    unsafe {
        asm!("mov.u64 {a}, smem;", a = out(reg64) a, options(pure, nomem, nostack));
    }
    a
}

#[inline(always)]
pub(super) fn cvt_f32_f16(h: u16) -> f32 {
    let f: f32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.f32.f16 {f}, {h};", f = out(reg32) f, h = in(reg16) h,
             options(pure, nomem, nostack));
    }
    f
}

#[inline(always)]
pub(super) fn cvt_rn_f16_f32(f: f32) -> u16 {
    let h: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {f};", h = out(reg16) h, f = in(reg32) f,
             options(pure, nomem, nostack));
    }
    h
}

#[inline(always)]
pub(super) fn cvt_rn_bf16_f32(f: f32) -> u16 {
    let h: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.bf16.f32 {h}, {f};", h = out(reg16) h, f = in(reg32) f,
             options(pure, nomem, nostack));
    }
    h
}

/// `mul.rn.f16x2`: the two f16 halves of `a` times those of `b`, each rounded to
/// nearest even, subnormals kept (no `.ftz`). sm_80's packed fp8 decode multiplies by
/// 2^8 with it (see [`super::fp8::packed`]).
#[allow(dead_code)] // unused where the hardware fp8 conversions serve instead
#[inline(always)]
pub(super) fn mul_rn_f16x2(a: u32, b: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only arithmetic.
    unsafe {
        asm!("mul.rn.f16x2 {d}, {a}, {b};", d = out(reg32) d, a = in(reg32) a,
             b = in(reg32) b, options(pure, nomem, nostack));
    }
    d
}

/// `prmt.b32 d, a, b, sel` (the default mode): see [`super::byte_perm`].
#[inline(always)]
pub(super) fn prmt(a: u32, b: u32, sel: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only arithmetic.
    unsafe {
        asm!("prmt.b32 {d}, {a}, {b}, {s};", d = out(reg32) d, a = in(reg32) a,
             b = in(reg32) b, s = in(reg32) sel, options(pure, nomem, nostack));
    }
    d
}

/// The hardware FP8 conversions behind [`super::fp8`]'s functions, with the same
/// names and operand order as [`super::fp8::soft`]: `sm_90`+, or `sm_89` with PTX ISA
/// 8.1 (the gate is in `fp8.rs`).
///
/// ISA operand order: `cvt.rn.satfinite.e4m3x2.f32 d, a, b` puts `a` in `d[15:8]` and
/// `b` in `d[7:0]`, so element 0 (`lo`) is `b`; `cvt.rn.f16x2.e4m3x2 d, a` widens
/// `a[7:0]` into `d[15:0]` and `a[15:8]` into `d[31:16]`.
#[cfg(any(
    target_feature = "sm_90",
    all(target_feature = "sm_89", target_feature = "ptx81")
))]
pub(super) mod fp8 {
    use core::arch::asm;

    macro_rules! fp8_cvt {
        ($pack:ident, $pack_insn:literal, $unpack:ident, $unpack_insn:literal,
         $enc:ident, $dec:ident) => {
            #[inline(always)]
            pub fn $pack(lo: f32, hi: f32) -> u16 {
                let d: u16;
                // SAFETY: register-only conversion.
                unsafe {
                    asm!(concat!($pack_insn, " {d}, {a}, {b};"), d = out(reg16) d,
                         a = in(reg32) hi, b = in(reg32) lo, options(pure, nomem, nostack));
                }
                d
            }

            #[inline(always)]
            pub fn $unpack(a: u16) -> u32 {
                let d: u32;
                // SAFETY: register-only conversion.
                unsafe {
                    asm!(concat!($unpack_insn, " {d}, {a};"), d = out(reg32) d,
                         a = in(reg16) a, options(pure, nomem, nostack));
                }
                d
            }

            #[inline(always)]
            pub fn $enc(f: f32) -> u8 {
                $pack(f, 0.0) as u8
            }

            #[inline(always)]
            pub fn $dec(b: u8) -> f32 {
                super::cvt_f32_f16($unpack(b as u16) as u16)
            }
        };
    }

    fp8_cvt!(
        f32x2_to_e4m3x2,
        "cvt.rn.satfinite.e4m3x2.f32",
        e4m3x2_to_f16x2,
        "cvt.rn.f16x2.e4m3x2",
        f32_to_e4m3,
        e4m3_to_f32
    );
    fp8_cvt!(
        f32x2_to_e5m2x2,
        "cvt.rn.satfinite.e5m2x2.f32",
        e5m2x2_to_f16x2,
        "cvt.rn.f16x2.e5m2x2",
        f32_to_e5m2,
        e5m2_to_f32
    );
}

impl Ctx for Gpu {
    #[inline(always)]
    fn thread_idx(&self) -> Dim3 {
        // SAFETY: reads special registers.
        unsafe {
            Dim3::new(
                nvptx::_thread_idx_x() as u32,
                nvptx::_thread_idx_y() as u32,
                nvptx::_thread_idx_z() as u32,
            )
        }
    }

    #[inline(always)]
    fn block_idx(&self) -> Dim3 {
        // SAFETY: reads special registers.
        unsafe {
            Dim3::new(
                nvptx::_block_idx_x() as u32,
                nvptx::_block_idx_y() as u32,
                nvptx::_block_idx_z() as u32,
            )
        }
    }

    #[inline(always)]
    fn block_dim(&self) -> Dim3 {
        // SAFETY: reads special registers.
        unsafe {
            Dim3::new(
                nvptx::_block_dim_x() as u32,
                nvptx::_block_dim_y() as u32,
                nvptx::_block_dim_z() as u32,
            )
        }
    }

    #[inline(always)]
    fn grid_dim(&self) -> Dim3 {
        // SAFETY: reads special registers.
        unsafe {
            Dim3::new(
                nvptx::_grid_dim_x() as u32,
                nvptx::_grid_dim_y() as u32,
                nvptx::_grid_dim_z() as u32,
            )
        }
    }

    #[inline(always)]
    fn sync_threads(&self) {
        // SAFETY: `bar.sync 0`; the kernel contract says every thread reaches it.
        unsafe { nvptx::_syncthreads() }
    }

    #[inline(always)]
    fn shfl_xor_u32(&self, v: u32, lane_mask: u32) -> u32 {
        let r: u32;
        // SAFETY: register exchange within the full warp.
        unsafe {
            asm!("shfl.sync.bfly.b32 {r}, {v}, {m}, 0x1f, 0xffffffff;",
                 r = out(reg32) r, v = in(reg32) v, m = in(reg32) lane_mask,
                 options(nomem, nostack));
        }
        r
    }

    #[inline(always)]
    fn exp2(&self, x: f32) -> f32 {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            asm!("ex2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x,
                 options(pure, nomem, nostack));
        }
        r
    }

    #[inline(always)]
    fn tanh(&self, x: f32) -> f32 {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            asm!("tanh.approx.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x,
                 options(pure, nomem, nostack));
        }
        r
    }

    #[inline(always)]
    fn log2(&self, x: f32) -> f32 {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            asm!("lg2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x,
                 options(pure, nomem, nostack));
        }
        r
    }

    #[inline(always)]
    fn fma(&self, a: f32, b: f32, c: f32) -> f32 {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            asm!("fma.rn.f32 {r}, {a}, {b}, {c};", r = out(reg32) r, a = in(reg32) a,
                 b = in(reg32) b, c = in(reg32) c, options(pure, nomem, nostack));
        }
        r
    }

    #[inline(always)]
    fn cp_async_16<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64) {
        let g = to_global(s.as_ptr().wrapping_add(i as usize) as *const u8);
        let a = smem_base() + 4 * word as u64;
        // SAFETY: 16 aligned, in-bounds, read-only global bytes (kernel contract) into
        // 16 aligned bytes of the launch's shared memory. Not `nomem`: it writes shared
        // memory, so the compiler keeps shared accesses in program order around it.
        unsafe {
            asm!("cp.async.cg.shared.global [{a}], [{g}], 16;",
                 a = in(reg64) a, g = in(reg64) g, options(nostack));
        }
    }

    #[inline(always)]
    fn cp_async_16_or_zero<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64, read: bool) {
        let g = to_global(s.as_ptr().wrapping_add(if read { i as usize } else { 0 }) as *const u8);
        let a = smem_base() + 4 * word as u64;
        let n: u32 = if read { 16 } else { 0 };
        // SAFETY: as `cp_async_16` when `read`; with a src-size of 0 no global byte is
        // read, and the 16 shared bytes are zero-filled.
        unsafe {
            asm!("cp.async.cg.shared.global [{a}], [{g}], 16, {n};",
                 a = in(reg64) a, g = in(reg64) g, n = in(reg32) n, options(nostack));
        }
    }

    #[inline(always)]
    fn cp_async_commit(&self) {
        // SAFETY: closes this thread's group of asynchronous copies; no operands.
        unsafe { asm!("cp.async.commit_group;", options(nostack)) }
    }

    #[inline(always)]
    fn cp_async_wait<const N: u32>(&self) {
        // SAFETY: waits for this thread's copies. Not `nomem`: shared-memory reads after
        // it must not be hoisted above it.
        unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) }
    }

    #[inline(always)]
    fn ldmatrix_x4<const TRANS: bool>(&self, word: u32) -> [u32; 4] {
        let a = smem_base() + 4 * word as u64;
        let (x, y, z, w): (u32, u32, u32, u32);
        // SAFETY: every lane gives a 16-byte aligned row inside the launch's shared
        // memory, and the whole warp calls together (kernel contract).
        unsafe {
            if TRANS {
                asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{x}, {y}, {z}, {w}}}, [{a}];",
                     x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                     a = in(reg64) a, options(readonly, nostack));
            } else {
                asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{x}, {y}, {z}, {w}}}, [{a}];",
                     x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                     a = in(reg64) a, options(readonly, nostack));
            }
        }
        [x, y, z, w]
    }

    #[inline(always)]
    fn ldmatrix_x2<const TRANS: bool>(&self, word: u32) -> [u32; 2] {
        let a = smem_base() + 4 * word as u64;
        let (x, y): (u32, u32);
        // SAFETY: as for `ldmatrix_x4` (lanes 0-15's addresses).
        unsafe {
            if TRANS {
                asm!("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {{{x}, {y}}}, [{a}];",
                     x = out(reg32) x, y = out(reg32) y, a = in(reg64) a,
                     options(readonly, nostack));
            } else {
                asm!("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{{x}, {y}}}, [{a}];",
                     x = out(reg32) x, y = out(reg32) y, a = in(reg64) a,
                     options(readonly, nostack));
            }
        }
        [x, y]
    }

    #[inline(always)]
    fn ldmatrix_x1<const TRANS: bool>(&self, word: u32) -> u32 {
        let a = smem_base() + 4 * word as u64;
        let x: u32;
        // SAFETY: as for `ldmatrix_x4` (lanes 0-7's addresses).
        unsafe {
            if TRANS {
                asm!("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {{{x}}}, [{a}];",
                     x = out(reg32) x, a = in(reg64) a, options(readonly, nostack));
            } else {
                asm!("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {{{x}}}, [{a}];",
                     x = out(reg32) x, a = in(reg64) a, options(readonly, nostack));
            }
        }
        x
    }

    #[inline(always)]
    fn mma_m16n8k16_f16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let (d0, d1, d2, d3): (f32, f32, f32, f32);
        // SAFETY: registers only; the whole warp calls together (kernel contract).
        unsafe {
            asm!("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                 d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                 a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                 b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                 c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                 options(pure, nomem, nostack));
        }
        [d0, d1, d2, d3]
    }

    #[inline(always)]
    fn mma_m16n8k16_bf16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let (d0, d1, d2, d3): (f32, f32, f32, f32);
        // SAFETY: registers only; the whole warp calls together (kernel contract).
        unsafe {
            asm!("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                 d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                 a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                 b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                 c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                 options(pure, nomem, nostack));
        }
        [d0, d1, d2, d3]
    }

    #[inline(always)]
    fn smem_ld_v4(&self, word: u32) -> [u32; 4] {
        let a = smem_base() + 4 * word as u64;
        let (x, y, z, w): (u32, u32, u32, u32);
        // SAFETY: 16 aligned bytes inside the launch's shared memory (kernel contract).
        unsafe {
            asm!("ld.shared.v4.u32 {{{x}, {y}, {z}, {w}}}, [{a}];",
                 x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                 a = in(reg64) a, options(readonly, nostack));
        }
        [x, y, z, w]
    }

    #[inline(always)]
    fn ld<T: Copy>(&self, s: &GlobalSlice<T>, i: u64) -> T {
        // SAFETY: the host validated `i < s.len()` (kernel contract).
        unsafe { core::ptr::read(s.as_ptr().add(i as usize)) }
    }

    #[inline(always)]
    fn st<T: Copy>(&self, s: &GlobalSliceMut<T>, i: u64, v: T) {
        // SAFETY: the host validated `i < s.len()` (kernel contract).
        unsafe { core::ptr::write(s.as_mut_ptr().add(i as usize), v) }
    }

    #[inline(always)]
    fn ld_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4] {
        let g = to_global(s.as_ptr().wrapping_add(i as usize) as *const u8);
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: 16 aligned, in-bounds bytes (kernel contract).
        unsafe {
            asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{g}];",
                 a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                 g = in(reg64) g, options(readonly, nostack));
        }
        [a, b, c, d]
    }

    #[inline(always)]
    fn ld_nc_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4] {
        let g = to_global(s.as_ptr().wrapping_add(i as usize) as *const u8);
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: 16 aligned, in-bounds bytes that nothing writes during the launch.
        unsafe {
            asm!("ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [{g}];",
                 a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                 g = in(reg64) g, options(pure, readonly, nostack));
        }
        [a, b, c, d]
    }

    #[inline(always)]
    fn st_v4<T>(&self, s: &GlobalSliceMut<T>, i: u64, v: [u32; 4]) {
        let g = to_global(s.as_mut_ptr().wrapping_add(i as usize) as *const u8);
        // SAFETY: 16 aligned, in-bounds, writable bytes (kernel contract).
        unsafe {
            asm!("st.global.v4.u32 [{g}], {{{a}, {b}, {c}, {d}}};",
                 g = in(reg64) g, a = in(reg32) v[0], b = in(reg32) v[1],
                 c = in(reg32) v[2], d = in(reg32) v[3], options(nostack));
        }
    }

    #[inline(always)]
    fn smem_ld_u32(&self, i: u32) -> u32 {
        let a = smem_base() + 4 * i as u64;
        let r: u32;
        // SAFETY: the launch sized shared memory for the kernel's indices.
        unsafe {
            asm!("ld.shared.u32 {r}, [{a}];", r = out(reg32) r, a = in(reg64) a,
                 options(readonly, nostack));
        }
        r
    }

    #[inline(always)]
    fn smem_st_u32(&self, i: u32, v: u32) {
        let a = smem_base() + 4 * i as u64;
        // SAFETY: the launch sized shared memory for the kernel's indices.
        unsafe {
            asm!("st.shared.u32 [{a}], {v};", a = in(reg64) a, v = in(reg32) v,
                 options(nostack));
        }
    }
}
