"""How an lm-eval task's generation settings (`generation_kwargs`) become the native decoder's
(vlmcore.eval.vlm.native_settings): `until` the stop strings, `max_gen_toks` the token budget,
greedy unless the task asks for sampling, and a setting the decoder has not refused by name, also
through `vlmcore eval` before any answer is generated."""

import pytest
from helpers import tiny_hf_snapshot

from vlmcore.data.synthetic.image import generate
from vlmcore.eval.runner import BUNDLED_TASKS, EvalSetupError, evaluate
from vlmcore.eval.vlm import cut_at_stops, native_settings


def test_until_and_max_gen_toks_are_the_stop_strings_and_budget_greedy_by_default():
    settings = native_settings({"do_sample": False}, ["<|im_end|>", "\n", ""], 8)
    assert settings.greedy and settings.max_new_tokens == 8 and settings.n == 1
    assert settings.stop_strings == ["<|im_end|>", "\n"]  # an empty stop string stops nothing
    assert native_settings({}, ["<|im_end|>"], 16).greedy
    # A temperature of 0, or any temperature with do_sample false, is greedy (transformers' reading).
    assert native_settings({"temperature": 0.0}, [], 4).greedy
    assert native_settings({"do_sample": False, "temperature": 0.7}, [], 4).greedy


def test_sampling_when_the_task_asks_for_it():
    settings = native_settings({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}, ["\n"], 32)
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.7, 0.9, 20)
    assert not settings.greedy and settings.max_new_tokens == 32 and settings.stop_strings == ["\n"]
    assert native_settings({"do_sample": True}, [], 4).temperature == 1.0  # transformers' default temperature
    assert not native_settings({"temperature": 0.5}, [], 4).greedy


def test_a_setting_the_native_decoder_has_not_is_refused_by_name():
    with pytest.raises(
        ValueError, match="generation_kwargs num_beams, repetition_penalty: not supported .*--generator"
    ):
        native_settings({"num_beams": 4, "repetition_penalty": 1.1, "do_sample": False}, [], 8)


def test_answers_are_cut_at_every_stop_sequence_in_turn():
    assert cut_at_stops("blue\nred<|im_end|>x", ["<|im_end|>", "\n"]) == "blue"
    assert cut_at_stops("blue", ["", "\n"]) == "blue"


@pytest.mark.slow
def test_eval_refuses_a_task_with_an_unsupported_setting_before_generating(tmp_path):
    """A task whose generation_kwargs has num_beams is refused by name under the native decoder;
    `--generator transformers` has no such refusal."""
    model = tiny_hf_snapshot("qwen3_vl", tmp_path / "model")
    generate(tmp_path / "raw", num_train=1, num_eval=2, seed=3)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "beams.yaml").write_text(
        f"include: {BUNDLED_TASKS / 'demo_vqa/demo_vqa_gen.yaml'}\n"
        "task: demo_vqa_beams\n"
        'generation_kwargs: {until: ["<|im_end|>"], max_gen_toks: 4, do_sample: false, num_beams: 2}\n'
    )

    def run(out: str, generator: str) -> dict:
        return evaluate(
            model,
            ["demo_vqa_beams"],
            tmp_path / out,
            vqa_data=tmp_path / "raw/eval.jsonl",
            include_path=[tasks],
            limit=2,
            batch_size=2,
            generator=generator,
        )

    with pytest.raises(ValueError, match="generation_kwargs num_beams: not supported by vlmcore's decoder"):
        run("native", "vlmcore")
    assert not (tmp_path / "native").exists()
    assert run("transformers", "transformers")["generator"] == "transformers"
    with pytest.raises(EvalSetupError, match="--generator: 'hf'; must be one of vlmcore, transformers"):
        run("bad", "hf")
