"""The workflow's export of a LoRA stage: the export job's adapter arguments (vlmcore.workflow
`Experiment.export_adapter_args`, which workflow/rules/export.smk passes on) run on a real tiny
LoRA stage write the merged model to hf/<stage> and the peft adapter directory inside it.
tests/workflow/test_workflow_dag.py checks that the rule passes them for LoRA stages only."""

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from helpers import train, write_config

from vlmcore.cli import main
from vlmcore.tiny import tiny_snapshot
from vlmcore.workflow import Experiment, validate_config

REPO = Path(__file__).resolve().parents[2]
LORA = {"rank": 4, "alpha": 8}


def lora_experiment(results_dir: Path) -> Experiment:
    """The demo with its stage2 a LoRA stage, its results under `results_dir`."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["results_dir"] = str(results_dir)
    config["train"]["stages"]["stage2"]["lora"] = LORA
    return Experiment(validate_config(config, REPO / "workflow/schemas/config.schema.yaml"))


@pytest.mark.slow
def test_export_of_a_lora_stage_writes_the_merged_model_and_its_peft_adapter(tmp_path):
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    exp = lora_experiment(tmp_path / "results")
    assert exp.export_adapter_args("stage1") == ""
    adapter_args = shlex.split(exp.export_adapter_args("stage2"))
    assert adapter_args == ["--peft-adapter", exp.path("hf", "stage2", "peft_adapter")]

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    stage_dir = Path(exp.path("train", "stage2"))
    train(
        1, write_config(tmp_path / "stage2.yaml", snapshot, stage_dir, steps=2, lora=exp.stage_config("stage2")["lora"])
    )
    export = Path(exp.path("hf", "stage2"))
    args = ["export", "--checkpoint", str(stage_dir / "final"), "--model", str(snapshot), "--out", str(export)]
    assert main([*args, *adapter_args]) == 0

    adapter = export / "peft_adapter"
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["rank"]
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    # peft's adapted base gives the merged export's logits; the adapters moved the model.
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_model = Qwen3VLForConditionalGeneration.from_pretrained(snapshot).eval()
        base = base_model(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base_model, adapter).eval()(input_ids=ids).logits
        merged = Qwen3VLForConditionalGeneration.from_pretrained(export).eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (adapted - base).abs().max() > 1e-4
