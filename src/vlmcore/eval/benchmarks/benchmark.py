"""The record of one public benchmark task: everything vlmcore knows of it, in one place.

Each benchmark module beside this one (`mmmu_val.py`, `videomme.py`, ...) defines its `BENCHMARK`,
a `Benchmark` holding where its data comes from (the hub repository, configs, split and media
archives the staging rule downloads), the fields its questions have, its prompt and media, its
record of one answer and its scores with their breakdowns, its headline metric and scale, its
chance level and the reference model's published score. The registry collects them; the lm-eval
tasks (vlmcore/eval/tasks/benchmarks/), the staging, the runner and the report read them there.

Torch-free and `datasets`-free at import: the workflow's planning reads the records (which
benchmarks there are to stage), and so does `vlmcore stage-benchmark` on a login node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets


@dataclass(frozen=True)
class Benchmark:
    name: str  # the name in eval.tasks (and lmms-eval's task name); its module's name
    hf_repo: str  # dataset repository on the Hugging Face hub (lmms-eval 0.7.3's dataset_path)
    split: str
    fields: tuple[str, ...]  # the fields every question must have (checked when the questions are read)
    doc_to_text: Callable[[dict], str]  # the prompt of one question
    doc_to_visual: Callable[[dict], list]  # its images (PIL) or video clips (vlmcore.eval.video_decode.VideoClip)
    record: Callable[[dict, str], dict]  # the record of one answer (the response stripped, as lmms-eval strips it)
    # The headline score and breakdowns of all records: {"score": float, "breakdown": {"<kind>/<value>": (score, n)}}
    scores: Callable[[list[dict]], dict]
    metric: str  # the headline metric in results.json (its scale: `scale`)
    scale: float = 1.0  # 1.0: the metric is a fraction; 100.0: a percentage (as lmms-eval reports it)
    # The metrics a record is when the benchmark scores each answer on its own (lm-eval averages
    # them and logs them one by one); () when its score needs all records at once.
    answer_metrics: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()  # dataset configs (subsets) to stage; () = the default one
    media_files: tuple[str, ...] = ()  # glob patterns of repository files the samples need (videos)
    revision: str | None = None  # the repository's branch or tag to stage (None: the default branch)
    modality: str = "image"  # image | video
    max_frames: int | None = None  # frames sampled per video at most (lmms-eval's Qwen3-VL default: 32)
    chance: float | None = None  # chance level of the headline metric, as a fraction (None: free-form answers)
    # Published score of the reference model ({model card name: headline metric in percent}), each
    # with its source URL beside it; only figures stated in text. None yet: the Qwen3-VL model cards
    # and https://github.com/QwenLM/Qwen3-VL/blob/main/README.md give their benchmark tables as
    # images, and the technical report's tables (https://arxiv.org/abs/2511.21631) were not at hand as text.
    published: dict[str, float] = field(default_factory=dict)
    # Its questions from the staged directory, when they are more than the table of its split
    # (MVBench's 20 task files, Video-MME's videos); None: read_split (vlmcore.eval.benchmarks.data).
    questions: Callable[[Path], datasets.Dataset] | None = None

    def process_results(self, doc: dict, response: str) -> dict:
        """lm-eval's per-sample metrics of one answer: the record's metrics when it scores each
        answer on its own, else the record under the headline metric (aggregated by `scores`)."""
        record = self.record(doc, response)
        return record if self.answer_metrics else {self.metric: record}

    def logged_records(self, samples: list[dict]) -> list[dict]:
        """The records of lm-eval's logged samples (their metrics as process_results gave them)."""
        if self.answer_metrics:
            return [{key: sample[key] for key in self.answer_metrics if key in sample} for sample in samples]
        return [sample[self.metric] for sample in samples]

    def breakdown(self, samples: list[dict]) -> dict:
        """Its per-subset scores of lm-eval's logged samples: {subset: {metric, value, chance, n}}."""
        figures = self.scores(self.logged_records(samples))["breakdown"]
        return {
            subset: {"metric": self.metric, "value": value, "chance": None, "n": n}
            for subset, (value, n) in figures.items()
        }
