"""The public benchmarks that `eval.tasks` can name, and where their data comes from.

One record per benchmark task: the Hugging Face dataset it reads (repository, configs, split), the
extra files its samples refer to (video archives, subtitles), its chance level and the score the
reference model card publishes. The login-node staging rule downloads from these records; the
task definitions and the scoring live beside this module.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Benchmark:
    name: str  # the name in eval.tasks (and lmms-eval's task name)
    hf_repo: str  # dataset repository on the Hugging Face hub
    split: str
    configs: tuple[str, ...] = ()  # dataset configs (subsets) to stage; () = the default one
    media_files: tuple[str, ...] = ()  # glob patterns of repository files the samples need (videos)
    modality: str = "image"  # image | video
    chance: float | None = None  # chance level of the headline metric (None: free-form answers)
    # Published score of the reference model (Qwen3-VL-8B-Instruct model card), headline metric.
    published: dict[str, float] = field(default_factory=dict)


BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark("mmmu_val", "lmms-lab/MMMU", split="validation"),
        Benchmark("chartqa", "lmms-lab/ChartQA", split="test"),
        Benchmark("docvqa_val", "lmms-lab/DocVQA", split="validation", configs=("DocVQA",)),
        Benchmark("mmbench_en_dev", "lmms-lab/MMBench", split="dev", configs=("en",)),
        Benchmark(
            "videomme",
            "lmms-lab/Video-MME",
            split="test",
            media_files=("videos_chunked_*.zip",),
            modality="video",
            chance=0.25,
        ),
        Benchmark(
            "videomme_w_subtitle",
            "lmms-lab/Video-MME",
            split="test",
            media_files=("videos_chunked_*.zip", "subtitle.zip"),
            modality="video",
            chance=0.25,
        ),
        Benchmark("mvbench", "OpenGVLab/MVBench", split="train", media_files=("video/*.zip",), modality="video"),
    )
}
