//! Warp-collective tensor-core instructions in the emulator: `ldmatrix` and
//! `mma.m16n8k16`, executed once for the whole warp when all 32 lanes have arrived,
//! with the PTX ISA's fragment layouts (see `Ctx::ldmatrix_x4` and
//! `Ctx::mma_m16n8k16_f16` in `pagedkv-kernels` for the layouts, stated once).
//!
//! `mma` multiplies exactly (16-bit products are exact in f64) and accumulates in f64,
//! rounding each output to f32 once. The GPU accumulates in f32 in an unspecified
//! order, so its results may differ in the last bits; the layouts, which decide which
//! element meets which, are exact.

use pagedkv_kernels::device::WARP_SIZE;
use pagedkv_kernels::device::{bf16_to_f32, f16_to_f32};

const LANES: usize = WARP_SIZE as usize;

/// One lane's part of a warp-collective instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WarpOp {
    /// `ldmatrix.m8n8.x{num}[.trans]`: this lane's row address (a byte offset in shared
    /// memory, checked by the lane: aligned and in range when the lane's row is used).
    LdMatrix { num: u8, trans: bool, byte: u32 },
    /// `mma.m16n8k16` (f16 or bf16 inputs, f32 accumulator bits in `c`).
    Mma {
        bf16: bool,
        a: [u32; 4],
        b: [u32; 2],
        c: [u32; 4],
    },
}

impl WarpOp {
    /// What every lane of the warp must agree on.
    fn kind(&self) -> (u8, bool, bool) {
        match *self {
            WarpOp::LdMatrix { num, trans, .. } => (num, trans, false),
            WarpOp::Mma { bf16, .. } => (0, false, bf16),
        }
    }
}

/// Executes one warp-collective instruction: `ops[lane]` is lane `lane`'s part;
/// returns each lane's result registers (unused ones 0), or why the lanes disagree.
pub(super) fn execute(ops: &[WarpOp; LANES], smem: &[u8]) -> Result<[[u32; 4]; LANES], String> {
    let k = ops[0].kind();
    if let Some(l) = ops.iter().position(|o| o.kind() != k) {
        return Err(format!(
            "lanes 0 and {l} run different warp instructions ({:?} and {:?})",
            ops[0], ops[l]
        ));
    }
    Ok(match ops[0] {
        WarpOp::LdMatrix { num, trans, .. } => ldmatrix(ops, smem, num as usize, trans),
        WarpOp::Mma { bf16, .. } => mma(ops, bf16),
    })
}

fn ldmatrix(ops: &[WarpOp; LANES], smem: &[u8], num: usize, trans: bool) -> [[u32; 4]; LANES] {
    // m[matrix][row][col]: the 16-bit elements, rows as lanes 8m..8m+8 address them.
    let mut m = [[[0u16; 8]; 8]; 4];
    for (mi, mat) in m.iter_mut().enumerate().take(num) {
        for (r, row) in mat.iter_mut().enumerate() {
            let WarpOp::LdMatrix { byte, .. } = ops[8 * mi + r] else {
                unreachable!("kinds checked")
            };
            let at = byte as usize;
            for (c, e) in row.iter_mut().enumerate() {
                *e = u16::from_le_bytes([smem[at + 2 * c], smem[at + 2 * c + 1]]);
            }
        }
    }
    let mut out = [[0u32; 4]; LANES];
    for (lane, regs) in out.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (mi, reg) in regs.iter_mut().enumerate().take(num) {
            let (lo, hi) = if trans {
                (m[mi][2 * t][g], m[mi][2 * t + 1][g])
            } else {
                (m[mi][g][2 * t], m[mi][g][2 * t + 1])
            };
            *reg = lo as u32 | (hi as u32) << 16;
        }
    }
    out
}

fn mma(ops: &[WarpOp; LANES], bf16: bool) -> [[u32; 4]; LANES] {
    let half = |reg: u32, h: usize| {
        let bits = (reg >> (16 * h)) as u16;
        f64::from(if bf16 {
            bf16_to_f32(bits)
        } else {
            f16_to_f32(bits)
        })
    };
    let (mut a, mut b, mut c) = ([[0f64; 16]; 16], [[0f64; 8]; 16], [[0f64; 8]; 16]);
    for (lane, op) in ops.iter().enumerate() {
        let WarpOp::Mma {
            a: fa,
            b: fb,
            c: fc,
            ..
        } = *op
        else {
            unreachable!("kinds checked")
        };
        let (g, t) = (lane / 4, lane % 4);
        for (j, &reg) in fa.iter().enumerate() {
            for h in 0..2 {
                a[g + 8 * (j % 2)][2 * t + 8 * (j / 2) + h] = half(reg, h);
            }
        }
        for (j, &reg) in fb.iter().enumerate() {
            for h in 0..2 {
                b[2 * t + 8 * j + h][g] = half(reg, h);
            }
        }
        for (i, &bits) in fc.iter().enumerate() {
            c[g + 8 * (i / 2)][2 * t + i % 2] = f64::from(f32::from_bits(bits));
        }
    }
    let mut out = [[0u32; 4]; LANES];
    for (lane, d) in out.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, di) in d.iter_mut().enumerate() {
            let (row, col) = (g + 8 * (i / 2), 2 * t + i % 2);
            let sum: f64 = (0..16).map(|k| a[row][k] * b[k][col]).sum::<f64>() + c[row][col];
            *di = (sum as f32).to_bits();
        }
    }
    out
}
