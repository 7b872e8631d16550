//! The emulator and the device layer, one test binary: conversions, the SIMT emulator,
//! fp8, the tensor-core fragments.

mod convert;
mod emulator;
mod fp8;
mod tensor_core;
