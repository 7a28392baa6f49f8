"""`check_resume` (hcp.train.checkpoint) names what differs between a checkpoint's trainable
parameters and this config's: frozen now, absent now (modules the config lacks), trained now."""
import json

import pytest

from cfg_utils import compose_cfg
from hcp.config.errors import ConfigError
from hcp.train.checkpoint import expected_trainable
from hcp.config.specs import resolve_modules
from cfg_utils import resume_check


def test_resume_into_a_config_without_a_module_says_absent_not_frozen(tmp_path):
    two = compose_cfg(["+recipe=llava_tiny_two_encoders"])
    saved = sorted(expected_trainable(resolve_modules(two)))
    (tmp_path / "trainer.json").write_text(json.dumps({"trainable": saved}))
    one = compose_cfg([f"resume={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        resume_check(one)
    msg = str(e.value)
    gone = [n for n in saved if n.split(".")[0] in ("vision2", "projector2")]
    assert gone and f"trained there, absent now ({len(gone)}): {gone[0]}" in msg
    assert "frozen now" not in msg and f"use init_from_checkpoint={tmp_path}" in msg


def test_resume_past_max_steps_is_refused_and_a_finished_run_is_not(tmp_path):
    (tmp_path / "trainer.json").write_text(json.dumps({"step": 400}))
    with pytest.raises(ConfigError, match=r"trainer.max_steps=2: .* already at step 400.*max_steps > 400"):
        resume_check(compose_cfg([f"resume={tmp_path}", "trainer.max_steps=2"]))
    resume_check(compose_cfg([f"resume={tmp_path}", "trainer.max_steps=400"]))
