//! [`decode_emulated`]: the real decode kernel (and its split-K reduce) in the SIMT
//! emulator, the CPU path the proofs run.

use super::{AttentionOut, DecodeInputs, SplitPlan};
use crate::emulator::Emulator;
use crate::error::Result;
use crate::step::EmuDevice;
use crate::tensor::HostTensor;

/// Runs the real decode kernel (and, for a split plan, the reduce kernel) in the
/// emulator, after [`validate_launch`](super::validate_launch): a one-shot use of the
/// step path ([`StepRunner::decode`](crate::step::StepRunner::decode) on an
/// [`EmuDevice`]), so this is the launch engines run. Without `inputs.plan` it never
/// splits (split-K exists to fill a GPU's SMs; on the CPU it only adds work). `out`
/// is the output tensor, or an [`AttentionOut`] with a log-sum-exp tensor too. Returns
/// the plan it ran.
pub fn decode_emulated<'o>(
    emu: &Emulator,
    inputs: DecodeInputs<'_, HostTensor>,
    out: impl Into<AttentionOut<'o, HostTensor>>,
) -> Result<SplitPlan> {
    crate::step::once::decode(EmuDevice::new(emu.clone()), None, inputs, out)
}
