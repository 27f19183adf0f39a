"""The public benchmarks that `eval.tasks` can name, and where their data comes from.

One record per benchmark task: the Hugging Face dataset it reads (repository, configs, split), the
extra files its samples refer to (video archives, subtitles), its chance level and the score the
reference model card publishes. The login-node staging rule downloads from these records; the
task definitions and the scoring live beside this module.
"""

from dataclasses import dataclass, field

# MVBench's 20 tasks: the dataset configs of OpenGVLab/MVBench (one JSON file each).
MVBENCH_TASKS = (
    "action_sequence",
    "moving_count",
    "action_prediction",
    "episodic_reasoning",
    "action_antonym",
    "action_count",
    "scene_transition",
    "object_shuffle",
    "object_existence",
    "fine_grained_pose",
    "unexpected_action",
    "moving_direction",
    "state_change",
    "object_interaction",
    "character_order",
    "action_localization",
    "counterfactual_inference",
    "fine_grained_action",
    "moving_attribute",
    "egocentric_navigation",
)


@dataclass(frozen=True)
class Benchmark:
    name: str  # the name in eval.tasks (and lmms-eval's task name)
    hf_repo: str  # dataset repository on the Hugging Face hub (lmms-eval 0.7.3's dataset_path)
    split: str
    configs: tuple[str, ...] = ()  # dataset configs (subsets) to stage; () = the default one
    media_files: tuple[str, ...] = ()  # glob patterns of repository files the samples need (videos)
    modality: str = "image"  # image | video
    chance: float | None = None  # chance level of the headline metric, as a fraction (None: free-form answers)
    # Published score of the reference model ({model card name: headline metric}), each with its
    # source URL beside it; only figures stated in text. None yet: the Qwen3-VL model cards and
    # https://github.com/QwenLM/Qwen3-VL/blob/main/README.md give their benchmark tables as images,
    # and the technical report's tables (https://arxiv.org/abs/2511.21631) were not at hand as text.
    published: dict[str, float] = field(default_factory=dict)
    revision: str | None = None  # the repository's branch or tag to stage (None: the default branch)
    metric: str = ""  # the headline metric in results.json (its scale: `scale`)
    scale: float = 1.0  # 1.0: the metric is a fraction; 100.0: a percentage (as lmms-eval reports it)
    max_frames: int | None = None  # frames sampled per video at most (lmms-eval's Qwen3-VL default: 32)


BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark("mmmu_val", "lmms-lab-encoder/MMMU", split="validation", metric="mmmu_acc"),
        Benchmark("chartqa", "lmms-lab-encoder/ChartQA", split="test", metric="relaxed_overall"),
        Benchmark("docvqa_val", "lmms-lab-encoder/DocVQA", split="validation", configs=("DocVQA",), metric="anls"),
        Benchmark(
            "mmbench_en_dev",
            "lmms-lab-encoder/MMBench",
            split="dev",
            configs=("en",),
            metric="mmbench_acc",
            scale=100.0,
        ),
        Benchmark(
            "videomme",
            "lmms-eval/Video-MME",
            split="test",
            media_files=("videos_chunked_*.zip",),
            modality="video",
            chance=0.25,
            metric="videomme_perception_score",
            scale=100.0,
            max_frames=32,
        ),
        Benchmark(
            "videomme_w_subtitle",
            "lmms-eval/Video-MME",
            split="test",
            media_files=("videos_chunked_*.zip", "subtitle.zip"),
            modality="video",
            chance=0.25,
            metric="videomme_perception_score",
            scale=100.0,
            max_frames=32,
        ),
        Benchmark(
            "mvbench",
            "OpenGVLab/MVBench",
            split="train",
            configs=MVBENCH_TASKS,
            media_files=("video/*.zip",),
            modality="video",
            revision="video",
            metric="mvbench_accuracy",
            scale=100.0,
            max_frames=32,
        ),
    )
}
