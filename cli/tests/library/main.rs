//! The CLI crate's library, one test binary: the serving simulator (`sim`) and the
//! fp8 accuracy study's qualitative facts (`fp8_accuracy`).

mod fp8_accuracy;
mod sim;
