//! What the interpreter refuses, each on a small hand-written kernel: every check fails
//! the launch with an error naming what went wrong and where; where a defect-free twin
//! of the kernel is cheap to write (stores, races, shuffles, cp.async), it runs.

use pagedkv_host::emulator::LaunchConfig;
use pagedkv_kernels::{Access, Dim3};
use pagedkv_ptx_interp::{Error, MathMode, Module};

mod kit;

fn run(body: &str, threads: u32, buf: &mut [u32], access: Access) -> Result<(), Error> {
    kit::launch(body, threads, 256, buf, access, MathMode::Exact).map(|_| ())
}

fn module(body: &str) -> String {
    kit::module(body)
}

fn fault(body: &str, threads: u32) -> String {
    let mut buf = vec![0u32; 64];
    match run(body, threads, &mut buf, Access::ReadWrite) {
        Err(Error::Fault { site, msg }) => format!("{site}: {msg}"),
        other => panic!("expected a fault, got {other:?}"),
    }
}

/// Thread t stores t at buf[t].
const STORE_TID: &str =
    "\tmul.wide.u32 %rd4, %r1, 4;\n\tadd.s64 %rd5, %rd2, %rd4;\n\tst.global.u32 [%rd5], %r1;";

#[test]
fn a_correct_kernel_runs() {
    let mut buf = vec![7u32; 64];
    run(STORE_TID, 64, &mut buf, Access::ReadWrite).unwrap();
    assert_eq!(buf, (0..64).collect::<Vec<u32>>());
}

#[test]
fn unsupported_constructs_name_file_and_line() {
    let e =
        Module::parse("test.ptx", &module("\tatom.global.add.u32 %r2, [%rd2], 1;")).unwrap_err();
    match e {
        Error::Parse { file, line, msg } => {
            assert_eq!(file, "test.ptx");
            assert_eq!(line, 24, "{msg}");
            assert!(msg.contains("atom.global.add.u32"), "{msg}");
        }
        e => panic!("{e:?}"),
    }
    let e = Module::parse("t", &module("\t.local .align 4 .b8 x[4];")).unwrap_err();
    assert!(e.to_string().contains(".local"), "{e}");
}

#[test]
fn global_accesses_outside_the_ranges_fail() {
    // One element past the end.
    let f = fault("\tst.global.u32 [%rd2+256], %r1;", 32);
    assert!(
        f.contains("store of 4 bytes") && f.contains("inside no range"),
        "{f}"
    );
    // Misaligned.
    let f = fault("\tld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd2+248];", 1);
    assert!(f.contains("not 16-byte aligned"), "{f}");
    // Overrunning: 16 bytes at the last 8 of a 248-byte buffer.
    let mut short = vec![0u32; 62];
    let e = run(
        "\tld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd2+240];",
        1,
        &mut short,
        Access::Read,
    )
    .unwrap_err();
    assert!(e.to_string().contains("overruns `buf`"), "{e}");
    // A generic address in the shared window is no global address.
    let f = fault("\tld.b32 %r2, [%rd3];", 1);
    assert!(f.contains("inside no range"), "{f}");
    // A read-only range refuses stores.
    let mut buf = vec![0u32; 64];
    let e = run(STORE_TID, 1, &mut buf, Access::Read).unwrap_err();
    assert!(
        e.to_string().contains("inside `buf`, a read-only range"),
        "{e}"
    );
}

#[test]
fn nc_loads_of_a_range_the_launch_writes_fail() {
    let f = fault(
        &format!("{STORE_TID}\n\tld.global.nc.v4.u32 {{%r2, %r3, %r4, %r5}}, [%rd2];"),
        1,
    );
    assert!(
        f.contains("ld.global.nc from `buf`, which this launch writes"),
        "{f}"
    );
}

#[test]
fn shared_races_fail_and_a_barrier_fixes_them() {
    // Thread t writes shared word t, then reads word t + 1 (mod 32).
    let body = |bar: &str| {
        format!(
            "\tshl.b32 %r2, %r1, 2;\n\tcvt.u64.u32 %rd6, %r2;\n\tadd.s64 %rd7, %rd3, %rd6;\n\
             \tst.shared.u32 [%rd7], %r1;\n{bar}\
             \tadd.s32 %r3, %r1, 1;\n\tand.b32 %r3, %r3, 31;\n\tshl.b32 %r3, %r3, 2;\n\tcvt.u64.u32 %rd8, %r3;\n\tadd.s64 %rd9, %rd3, %rd8;\n\
             \tld.shared.u32 %r4, [%rd9];\n\
             \tmul.wide.u32 %rd4, %r1, 4;\n\tadd.s64 %rd5, %rd2, %rd4;\n\tst.global.u32 [%rd5], %r4;"
        )
    };
    let f = fault(&body(""), 32);
    // Thread 0 read word 1 before thread 1 wrote it: the write is the race.
    assert!(f.contains("race") && f.contains("thread 0 read it"), "{f}");
    let mut buf = vec![0u32; 64];
    run(&body("\tbar.sync 0;\n"), 32, &mut buf, Access::ReadWrite).unwrap();
    assert_eq!(&buf[..4], &[1, 2, 3, 4]);
    assert_eq!(buf[31], 0);
    // Out of the 256 bytes.
    let f = fault("\tst.shared.u32 [%rd3+256], %r1;", 1);
    assert!(f.contains("outside the 256 bytes of shared memory"), "{f}");
}

#[test]
fn barriers_some_threads_skip_fail() {
    // Threads 32.. exit before the barrier the others wait at.
    let f = fault(
        "\tsetp.gt.u32 %p1, %r1, 31;\n\t@%p1 bra $L__done;\n\tbar.sync 0;\n$L__done:",
        64,
    );
    assert!(
        f.contains("bar.sync reached by 32 threads while 32 exited"),
        "{f}"
    );
}

#[test]
fn shuffles_with_missing_lanes_fail() {
    let shfl = "\tshfl.sync.bfly.b32 %r2, %r1, 1, 0x1f, 0xffffffff;";
    let mut buf = vec![0u32; 64];
    run(shfl, 32, &mut buf, Access::ReadWrite).unwrap();
    // Lanes 16.. branch around it.
    let f = fault(
        &format!("\tsetp.gt.u32 %p1, %r1, 15;\n\t@%p1 bra $L__skip;\n{shfl}\n$L__skip:"),
        32,
    );
    assert!(
        f.contains("member mask 0xffffffff") && f.contains("lanes [0,1,2"),
        "{f}"
    );
    // A partial warp cannot do a full-mask shuffle either.
    let f = fault(shfl, 16);
    assert!(f.contains("member mask"), "{f}");
}

#[test]
fn cp_async_is_asynchronous() {
    // Thread 0 copies buf[0..4] to shared 0 and reads it back: only after the wait.
    let copy = "\tcp.async.cg.shared.global [%rd3], [%rd2], 16;\n\tcp.async.commit_group;";
    let read = "\tld.shared.u32 %r2, [%rd3];\n\tst.global.u32 [%rd2+64], %r2;";
    let mut buf: Vec<u32> = (10..74).collect();
    run(
        &format!("{copy}\n\tcp.async.wait_group 0;\n{read}"),
        1,
        &mut buf,
        Access::ReadWrite,
    )
    .unwrap();
    assert_eq!(buf[16], 10);
    // Read before the wait.
    let f = fault(&format!("{copy}\n{read}\n\tcp.async.wait_group 0;"), 1);
    assert!(f.contains("not yet waited for"), "{f}");
    // wait_group 1 with one group committed retires nothing.
    let f = fault(&format!("{copy}\n\tcp.async.wait_group 1;\n{read}"), 1);
    assert!(f.contains("not yet waited for"), "{f}");
    // Exit with the copy in flight.
    let f = fault(copy, 1);
    assert!(f.contains("exit with a cp.async"), "{f}");
    // A store to the copy's source before the wait.
    let f = fault(
        &format!("{copy}\n\tst.global.u32 [%rd2+4], %r1;\n\tcp.async.wait_group 0;"),
        1,
    );
    assert!(f.contains("the source of thread 0's cp.async"), "{f}");
}

#[test]
fn a_panic_reports_its_rust_location_and_trap_stops() {
    let m = Module::parse("t", &module(kit::PANIC)).unwrap();
    let e = kit::launch_bare(&m, 2).unwrap_err();
    match e {
        Error::Panic {
            file,
            line,
            col,
            func,
            site,
        } => {
            // loc = {file, 4, line 7 | col 12 << 32}
            assert_eq!((file.as_str(), line, col), ("k.rs", 7, 12));
            assert_eq!(func, "die");
            assert_eq!((site.block, site.thread), ([0, 0, 0], Some(0)));
        }
        e => panic!("{e:?}"),
    }
    let mut buf = vec![0u32; 64];
    let e = run("\ttrap;", 1, &mut buf, Access::ReadWrite).unwrap_err();
    assert!(matches!(e, Error::Trap { .. }), "{e:?}");
}

#[test]
fn launches_the_declaration_does_not_fit_are_refused() {
    let m = Module::parse("t", &module("")).unwrap();
    let cfg = LaunchConfig {
        grid: Dim3::new(1, 1, 1),
        block: Dim3::new(32, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: refused before it runs.
    let e = unsafe { m.launch_bytes("k", cfg, &[0; 24], 8, &[], MathMode::Exact) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("16 bytes aligned to 8, the host's struct 24 bytes"),
        "{e}"
    );
    let e = unsafe { m.launch_bytes("nope", cfg, &[0; 16], 8, &[], MathMode::Exact) }.unwrap_err();
    assert!(e.to_string().contains("not an entry point"), "{e}");
    let big = LaunchConfig {
        block: Dim3::new(2048, 1, 1),
        ..cfg
    };
    let e = unsafe { m.launch_bytes("k", big, &[0; 16], 8, &[], MathMode::Exact) }.unwrap_err();
    assert!(e.to_string().contains("1 to 1024 threads"), "{e}");
}

/// An upload whose end wraps the address space is refused (it used to pass the
/// "inside an allocation" check in release builds and write anywhere).
#[test]
fn uploads_that_wrap_are_refused() {
    use pagedkv_host::step::{DeviceAddr, EmuDevice, StepDevice};
    use pagedkv_ptx_interp::PtxDevice;
    use std::sync::Arc;
    fn check<D: StepDevice>(mut dev: D) {
        dev.alloc(64).unwrap();
        dev.reserve_upload(8).unwrap();
        let e = dev
            .upload(DeviceAddr::new(u64::MAX - 3), &[0; 8])
            .unwrap_err();
        assert!(e.to_string().contains("not inside an allocation"), "{e}");
    }
    check(EmuDevice::new(pagedkv_host::emulator::Emulator::new()));
    let m = Module::parse("t", &module("")).unwrap();
    check(PtxDevice::new(Arc::new(m), MathMode::Exact));
}

/// A cp.async is a write from its issue to its wait: another thread's read of the same
/// bytes since the last barrier is a race, and a barrier between them fixes it.
#[test]
fn cp_async_into_bytes_another_thread_read_is_a_race() {
    let body = |bar: &str| {
        format!(
            "\tsetp.eq.u32 %p1, %r1, 0;\n\t@%p1 ld.shared.u32 %r2, [%rd3];\n{bar}\
             \tsetp.eq.u32 %p2, %r1, 1;\n\t@!%p2 bra $L__out;\n\
             \tcp.async.cg.shared.global [%rd3], [%rd2], 16;\n\tcp.async.commit_group;\n\
             \tcp.async.wait_group 0;\n$L__out:"
        )
    };
    let f = fault(&body(""), 32);
    assert!(f.contains("race") && f.contains("thread 0 read it"), "{f}");
    let mut buf = vec![0u32; 64];
    run(&body("\tbar.sync 0;\n"), 32, &mut buf, Access::ReadWrite).unwrap();
}

/// `bar.sync` is `.aligned`: the lanes of a warp at two different barrier instructions
/// fail; two warps at two different ones do not.
#[test]
fn a_warp_split_between_two_barriers_fails() {
    let body = |bit: u32| {
        format!(
            "\tand.b32 %r2, %r1, {bit};\n\tsetp.eq.u32 %p1, %r2, 0;\n\t@%p1 bra $L__even;\n\
             \tbar.sync 0;\n\tbra.uni $L__done;\n$L__even:\n\tbar.sync 0;\n$L__done:"
        )
    };
    let f = fault(&body(1), 64);
    assert!(f.contains("warp 0 is at two barriers"), "{f}");
    let mut buf = vec![0u32; 64];
    run(&body(32), 64, &mut buf, Access::ReadWrite).unwrap();
}

/// Two half-warps may shuffle at one instruction, each within its own member mask.
#[test]
fn half_warps_shuffle_within_their_own_masks() {
    let body = "\tsetp.lt.u32 %p1, %r1, 16;\n\tselp.b32 %r3, 65535, -65536, %p1;\n\
        \tadd.s32 %r2, %r1, 100;\n\tshfl.sync.bfly.b32 %r4, %r2, 1, 0x1f, %r3;\n\
        \tmul.wide.u32 %rd4, %r1, 4;\n\tadd.s64 %rd5, %rd2, %rd4;\n\tst.global.u32 [%rd5], %r4;";
    let mut buf = vec![0u32; 64];
    run(body, 32, &mut buf, Access::ReadWrite).unwrap();
    assert_eq!(&buf[..4], &[101, 100, 103, 102]);
    assert_eq!(buf[17], 116);
    // A mask that names a lane of the other group does not.
    let f = fault(&body.replace("65535, -65536", "131071, -65536"), 32);
    assert!(f.contains("member mask 0x0001ffff"), "{f}");
}

/// A thread spinning on memory another thread would write never finishes here: it
/// fails instead of hanging.
#[test]
fn a_spin_wait_fails_instead_of_hanging() {
    let f = fault("$L__spin:\n\tbra.uni $L__spin;", 1);
    assert!(f.contains("without reaching a collective or exit"), "{f}");
}

/// What the parser refuses besides unknown opcodes.
#[test]
fn registers_of_the_wrong_width_and_bad_module_data_are_refused() {
    let e = Module::parse("t", &module("\tsetp.lt.u32 %p1, %rd1, 5;")).unwrap_err();
    assert!(
        e.to_string()
            .contains("`%rd1` (64 bits) where the instruction reads 32"),
        "{e}"
    );
    // Destinations: each instruction's written width, from its type (a predicate for
    // setp, the wide product for mul.wide, a cvt's first type).
    for (body, want) in [
        (
            "\tadd.s32 %rd4, %r1, 1;",
            "`%rd4` (64 bits) where the instruction writes 32",
        ),
        (
            "\tsetp.lt.u32 %r2, %r1, 5;",
            "`%r2` (32 bits) where the instruction writes 1",
        ),
        (
            "\tmul.wide.u32 %r2, %r1, 4;",
            "`%r2` (32 bits) where the instruction writes 64",
        ),
        (
            "\tcvt.u64.u32 %r2, %r1;",
            "`%r2` (32 bits) where the instruction writes 64",
        ),
        (
            "\tcvt.rn.f16.f32 %r2, %r1;",
            "`%r2` (32 bits) where the instruction writes 16",
        ),
        (
            "\tselp.b32 %rs2, %r1, %r1, %p1;",
            "`%rs2` (16 bits) where the instruction writes 32",
        ),
        (
            "\tselp.b32 %r2, %r1, %r1, %r3;",
            "`%r3` (32 bits) where the instruction reads 1",
        ),
        (
            "\tshfl.sync.bfly.b32 %rd4, %r1, 1, 31, -1;",
            "`%rd4` (64 bits) where the instruction writes 32",
        ),
        (
            "\tld.global.b64 %r2, [%rd2];",
            "`%r2` (32 bits) where the load writes 64",
        ),
        (
            "\tld.global.b32 %p2, [%rd2];",
            "`%p2` (1 bits) where the load writes 32",
        ),
    ] {
        let e = Module::parse("t", &module(body)).unwrap_err();
        assert!(e.to_string().contains(want), "{body}: {e}");
    }
    // A load may write a wider register (zero-extended), as rustc's `ld.param.b32 %rd`.
    Module::parse("t", &module("\tld.global.b32 %rd4, [%rd2];")).unwrap();
    let e = Module::parse(
        "t",
        &module("").replace(".address_size 64", ".address_size 32"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("only 64"), "{e}");
    let e = Module::parse("t", &module("").replace("{107, 46,", "{300, 46,")).unwrap_err();
    assert!(e.to_string().contains("300 does not fit"), "{e}");
}

/// Coverage lists a loop block no launch ran (one that may exit, though it otherwise
/// goes on to a panic), and not the branch that only leads to a panic (a block whose
/// every path traps or calls a panic function).
#[test]
fn coverage_names_unrun_loop_blocks_but_not_panic_paths() {
    let body = "\tmov.u32 %r2, 0;\n\tmov.u32 %r3, 0;\n\
        $L__loop:\n\tsetp.lt.u32 %p1, %r2, 100;\n\t@%p1 bra $L__ok;\n\tbra.uni $L__die;\n\
        $L__ok:\n\tsetp.eq.b32 %p2, %r2, 77;\n\t@!%p2 bra $L__next;\n\
        \tadd.s32 %r3, %r3, 1;\n\tsetp.eq.b32 %p4, %r3, 5;\n\t@%p4 exit;\n\tbra.uni $L__die;\n\
        $L__next:\n\tadd.s32 %r2, %r2, 1;\n\tsetp.lt.u32 %p3, %r2, 4;\n\t@%p3 bra $L__loop;\n\
        \tbra.uni $L__end;\n\
        $L__die:\n";
    let src = module(&format!("{body}{}\n$L__end:", kit::PANIC));
    let m = Module::parse("t", &src).unwrap();
    kit::launch_bare(&m, 1).unwrap();
    let line_of = |text: &str| 1 + src.lines().position(|l| l.contains(text)).unwrap() as u32;
    let c = m.coverage().into_iter().find(|c| c.kernel == "k").unwrap();
    assert_eq!(c.missed_in_loops, [line_of("add.s32 %r3")], "{c:?}");
    // The branch to the panic and the panic itself did not run either.
    assert!(c.missed.contains(&line_of("bra.uni $L__die")), "{c:?}");
    assert!(c.missed.contains(&line_of("mov.b64 %rd10, loc")), "{c:?}");
}
