//! The C ABI, one test binary: C programs compiled, linked and run (`c_program`), and
//! the fp8 functions (`fp8`).

mod c_program;
mod fp8;
