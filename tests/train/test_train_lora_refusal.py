"""A LoRA stage on a dense model with `lora.targets: []`: `lora.experts` (true by default) adapts
routed experts only, so nothing would train. `vlmcore train` refuses it naming lora.targets, the
key the user set (the optimizer's `trainable: no trainable parameters` named a key the user had
not touched), with exit code 2, before anything is written; the checks of the run refuse it from
the model's config alone, as the workflow does when it is parsed, and pass it on a model with
experts."""

import pytest
from helpers import train, write_config

from vlmcore.config import ConfigError, from_dict
from vlmcore.parallel.checks import check_run
from vlmcore.tiny import hf_config, tiny_snapshot

MESSAGE = (
    "lora.targets: must hold a pattern on the qwen3 model, which has no routed experts for lora.experts to "
    "adapt (else nothing would train)"
)


def test_lora_without_targets_on_a_dense_model_is_refused_naming_lora_targets(tmp_path):
    snapshot = tiny_snapshot("qwen3", tmp_path / "model")
    out = tmp_path / "run"
    config = write_config(tmp_path / "stage.yaml", snapshot, out, steps=2, lora={"rank": 4, "targets": []})
    proc = train(1, config, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {config}: {MESSAGE}"
    assert "Traceback" not in proc.stderr and not out.exists()

    cfg = from_dict(
        {"model_path": "m", "output_dir": "o", "data": {"kind": "random"}, "lora": {"rank": 4, "targets": []}}
    )
    with pytest.raises(ConfigError) as error:
        check_run(cfg, 1, hf_config("qwen3"))
    assert (error.value.key, str(error.value)) == ("lora.targets", MESSAGE)
    check_run(cfg, 1, hf_config("qwen3_moe"))  # the routed experts get adapters
