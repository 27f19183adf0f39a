"""The workflow's export of a LoRA stage that started from an earlier stage (the demo's stage2,
`init_from: stage1`): the export job's arguments (vlmcore.workflow `Experiment.export_adapter_args`
and `export_provenance`, which workflow/rules/export.smk passes on) run on real tiny stages write
the merged model to hf/<stage>, the peft adapter directory inside it, whose base is stage1's export
(the weights its adapters were trained on), and the provenance of the stage's lineage.
tests/workflow/test_workflow_dag.py checks that the rule passes them for LoRA stages only, and declares
what they read."""

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
def test_export_of_a_lora_stage_writes_the_merged_model_and_its_peft_adapter_on_its_base(tmp_path):
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    exp = lora_experiment(tmp_path / "results")
    assert exp.export_adapter_args("stage1") == ""
    adapter_args = shlex.split(exp.export_adapter_args("stage2"))
    assert adapter_args == [
        "--peft-adapter",
        exp.path("hf", "stage2", "peft_adapter"),
        "--peft-base",
        exp.path("hf", "stage1"),
    ]

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    stage1, stage2 = Path(exp.path("train", "stage1")), Path(exp.path("train", "stage2"))
    train(1, write_config(tmp_path / "stage1.yaml", snapshot, stage1, steps=2))
    lora = exp.stage_config("stage2")["lora"]
    train(
        1, write_config(tmp_path / "stage2.yaml", snapshot, stage2, steps=2, lora=lora, init_from=str(stage1 / "final"))
    )

    def export(stage: str, *extra: str) -> Path:
        out = Path(exp.path("hf", stage))
        provenance = exp.export_provenance(stage)["stage_configs"]
        args = ["export", "--checkpoint", exp.path("train", stage, "final"), "--model", str(snapshot)]
        assert main([*args, "--out", str(out), *(f"--stage-config={p}" for p in provenance), *extra]) == 0
        return out

    # Without stage1's export the adapter has no base to name: refused before anything is written.
    assert main(["export", "--checkpoint", str(stage2 / "final"), "--model", str(snapshot), "--out", exp.path("hf", "stage2"), *adapter_args[:2]]) == 2  # fmt: skip
    assert not Path(exp.path("hf", "stage2")).exists()
    export("stage1")
    merged_dir = export("stage2", *adapter_args)
    assert set(json.loads((merged_dir / "provenance.json").read_text())["stages"]) == {"stage1", "stage2"}

    adapter = merged_dir / "peft_adapter"
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["r"] == LORA["rank"] and adapter_config["base_model_name_or_path"] == exp.path("hf", "stage1")
    assert (merged_dir / "config.json").is_file() and list(merged_dir.glob("*.safetensors"))
    # peft's adapted base, the one the adapter names, gives the merged export's logits; the adapters
    # moved the model, and on the snapshot (a projector they never saw) they give other logits.
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_model = Qwen3VLForConditionalGeneration.from_pretrained(adapter_config["base_model_name_or_path"]).eval()
        base = base_model(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base_model, adapter).eval()(input_ids=ids).logits
        merged = Qwen3VLForConditionalGeneration.from_pretrained(merged_dir).eval()(input_ids=ids).logits
        snapshot_model = Qwen3VLForConditionalGeneration.from_pretrained(snapshot).eval()
        on_snapshot = PeftModel.from_pretrained(snapshot_model, adapter).eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (adapted - base).abs().max() > 1e-4
    assert (on_snapshot - merged).abs().max() > 1e-3
