"""A checkpoint save and a resume hold no more than training does (issue 39 section 1): under
FSDP x TP the state is saved and loaded as the shards training holds (DTensors over the 2-D mesh
DP x CP, TP), not gathered whole over DP x CP on every rank as `full_state_dict` did. Measured on
one rank of a 32-rank world under fake tensors (hcp.preflight.rehearse.checkpoint_memory); the
full-size figures are in docs/checkpoints.md (scripts/checkpoint_memory.py)."""
import pytest

from cfg_utils import compose_cfg, with_specs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_and_resume_peaks_stay_within_10_percent_of_the_training_peak(tmp_path):
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse.checkpoint_memory import checkpoint_peaks
    from hcp.preflight.rehearse.runner import rehearsal_config

    cfg = compose_cfg(["mode=rehearse", "+recipe=llama_tiny", "llm.layout.tp=2", "llm.layout.dp_shard=true",
                       "launcher.nproc_per_node=32", "trainer.global_batch_size=32", "data.max_seq_len=64",
                       "trainer.micro_batch_tokens=64", "llm.ffn_hidden_size=4096"], run_dir=str(tmp_path))
    validate(cfg, 32)
    list(prepare_data(*with_specs(cfg)))
    peaks = checkpoint_peaks(rehearsal_config(cfg), str(tmp_path), 0, 32)
    assert peaks["held"] < peaks["train"]
    assert peaks["save"] <= 1.1 * peaks["train"], peaks  # gathered whole over dp 16: 1.12x
    assert peaks["resume"] <= 1.1 * peaks["train"], peaks
    assert peaks["save"] - peaks["held"] <= 0.01 * peaks["train"], peaks  # nothing beyond the shards
