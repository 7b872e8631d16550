//! A harness for hand-written kernels: one entry `k(.param .align 8 .b8 k_param_0[16])`
//! (a pointer and a length) over a `u32` buffer.

#![allow(dead_code)] // each test binary uses part of it

use pagedkv_host::emulator::LaunchConfig;
use pagedkv_kernels::{Access, Dim3, GlobalRange};
use pagedkv_ptx_interp::{Error, LaunchStats, MathMode, Module};

/// A module whose entry `k` runs `body` after: `%rd1`/`%rd2` = the buffer, `%r1` =
/// `%tid.x`, `%rd3` = the shared window's start. Registers: `%p<16>`, `%rs<16>`,
/// `%r<64>`, `%rd<32>`.
pub fn module(body: &str) -> String {
    format!(
        ".version 7.8\n.target sm_90\n.address_size 64\n\
         .extern .shared .align 16 .b8 smem[];\n\
         .global .align 1 .b8 file[7] = {{107, 46, 114, 115, 0, 0, 0}};\n\
         .global .align 8 .u64 loc[3] = {{generic(file), 4, 51539607559}};\n\
         .func die(\n\t.param .b64 die_param_0\n)\n.noreturn;\n\
         .visible .entry k(\n\t.param .align 8 .b8 k_param_0[16]\n)\n{{\n\
         \t.reg .pred %p<16>;\n\t.reg .b16 %rs<16>;\n\t.reg .b32 %r<64>;\n\t.reg .b64 %rd<32>;\n\
         \tld.param.b64 %rd1, [k_param_0];\n\tcvta.to.global.u64 %rd2, %rd1;\n\
         \tmov.u32 %r1, %tid.x;\n\tmov.u64 %rd3, smem;\n{body}\n\tret;\n}}\n\
         .func die(\n\t.param .b64 die_param_0\n)\n.noreturn\n{{\n\ttrap; exit;\n}}\n"
    )
}

/// Launches `k` (one block of `threads`, `shared` bytes) over `buf`.
pub fn launch(
    body: &str,
    threads: u32,
    shared: u32,
    buf: &mut [u32],
    access: Access,
    math: MathMode,
) -> Result<LaunchStats, Error> {
    let m = Module::parse("test.ptx", &module(body)).expect("parses");
    let mut params = Vec::new();
    params.extend_from_slice(&(buf.as_mut_ptr() as u64).to_le_bytes());
    params.extend_from_slice(&(buf.len() as u64).to_le_bytes());
    let range = GlobalRange {
        name: "buf",
        addr: buf.as_mut_ptr() as u64,
        bytes: 4 * buf.len() as u64,
        access,
    };
    let cfg = LaunchConfig {
        grid: Dim3::new(1, 1, 1),
        block: Dim3::new(threads, 1, 1),
        shared_bytes: shared,
    };
    // SAFETY: the range is `buf`, borrowed mutably for the launch.
    unsafe { m.launch_bytes("k", cfg, &params, 8, &[range], math) }
}

/// A body that calls the panic function `die` with `loc` (file `k.rs`, line 7, column
/// 12).
pub const PANIC: &str = "\tmov.b64 %rd10, loc;\n\tcvta.global.u64 %rd11, %rd10;\n\t{ // callseq 0, 0\n\t.param .b64 param0;\n\tst.param.b64 [param0], %rd11;\n\tcall.uni die, (param0);\n\t}";

/// Launches entry `k` of `m` on `blocks` blocks of 32 threads with a buffer pointer
/// that maps no range: for kernels that touch no global memory.
pub fn launch_bare(m: &Module, blocks: u32) -> Result<LaunchStats, Error> {
    let params: Vec<u8> = [16u64, 4].iter().flat_map(|x| x.to_le_bytes()).collect();
    let cfg = LaunchConfig {
        grid: Dim3::new(blocks, 1, 1),
        block: Dim3::new(32, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: no range is registered, so the kernel can touch no host memory.
    unsafe { m.launch_bytes("k", cfg, &params, 8, &[], MathMode::Exact) }
}

/// Address of word `%r{idx}` of the buffer into `%rd{dst}` (uses `%rd30`).
pub fn word_addr(dst: u32, idx: u32) -> String {
    format!("\tmul.wide.u32 %rd30, %r{idx}, 4;\n\tadd.s64 %rd{dst}, %rd2, %rd30;\n")
}
