"""Qwen3-VL (transformers `Qwen3VLForConditionalGeneration` layout), and Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`): the same model whose decoder layers have sparse
mixture-of-experts MLPs (models/moe.py; the router always renormalises its top-k).

Vision tower: Conv3d patch embedding, learned position table bilinearly resampled to each image
grid, 2-D rotary, pre-norm blocks with a fused `attn.qkv`, a patch merger to the LLM width and
DeepStack mergers whose outputs are added to the hidden states of the first LLM layers at image
positions. LLM: the Qwen3 decoder with interleaved multimodal RoPE (t, h, w).

The vision tower's tensor-parallel plan, with its own degree, is in vlmcore.parallel.tp.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from .attention import attention
from .layers import GridThw, VisualTokens, apply_rotary, grid_list, head_dim_of, mrope_cos_sin, rope_inv_freq
from .parts import ModelCache, ModelOutput, VisionLanguageParts, varies_by_batch
from .qwen3 import Qwen3TextModel

DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' value when the config has none
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {name!r} is not supported ({sorted(VISION_ACTIVATIONS)})")
    return VISION_ACTIVATIONS[name]


class PatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.in_channels = config.in_channels
        self.kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, self.kernel, stride=self.kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, self.in_channels, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.n_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(1, n, 3, -1, self.head_dim).unbind(2)
        # Rotary in fp32, as transformers does for the vision tower.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        out = attention(q, k, v, cu_seqlens, max_seqlen, causal=False)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Groups each spatial_merge_size**2 block of patches into one LLM token.

    The DeepStack mergers normalise after grouping (`postshuffle_norm`), the final merger before.
    """

    def __init__(self, config: PretrainedConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def merge_block_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w, ...) -> (h*w, ...) in the order the patch processor emits: merge blocks, then rows inside."""
    h, w = grid.shape[:2]
    grid = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:]).transpose(1, 2)
    return grid.reshape(h * w, *grid.shape[4:])


class VisionModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.head_dim = config.hidden_size // config.num_heads
        self.grid_side = int(config.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", []) or [])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in self.deepstack_visual_indexes
        )

    def position_embeddings(self, grids: list[list[int]]) -> torch.Tensor:
        """The learned (side, side) table resampled to each image's (h, w) grid, in patch order."""
        table = self.pos_embed.weight.view(self.grid_side, self.grid_side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)
            grid = merge_block_order(grid[0].permute(1, 2, 0), self.merge).to(table.dtype)
            out.append(grid.repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (1, N, head_dim) of the 2-D rotary: half the frequencies follow rows, half columns."""
        inv_freq = rope_inv_freq(self.config.rope_parameters, self.head_dim // 2, "vision_config", "axial").to(device)
        coords = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            hw = merge_block_order(torch.stack((rows, cols), dim=-1), self.merge)
            coords.append(hw.repeat(t, 1))
        freqs = (torch.cat(coords)[..., None].float() * inv_freq).flatten(1)  # (N, head_dim / 2): rows, columns
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridThw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (image embeddings (N / merge**2, out_hidden), [DeepStack features of the same shape]).
        `grid_thw`: a (N, 3) tensor or a list of [t, h, w] (host ints: no GPU sync)."""
        grids = grid_list(grid_thw)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # each frame of each image attends only to itself
        x = self.patch_embed(pixel_values)
        if x.shape[0] != sum(lengths):
            raise ValueError(
                f"pixel_values has {x.shape[0]} patches but image_grid_thw {grids} describes {sum(lengths)}"
            )
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rotary(grids, x.device)
        cu_seqlens = F.pad(torch.tensor(lengths, device=x.device).cumsum(0, dtype=torch.int32), (1, 0))
        # Batches hold more or fewer images, of other sizes: the blocks' patches and images vary.
        varies_by_batch(x)
        varies_by_batch(cos, dim=1)
        varies_by_batch(sin, dim=1)
        varies_by_batch(cu_seqlens)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens, max_seqlen=max(lengths))
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


class LanguageModel(Qwen3TextModel):
    """The Qwen3 decoder with interleaved M-RoPE and DeepStack."""

    config_name = "qwen3_vl text_config"

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the interleaved M-RoPE of (3, B, S) positions."""
        rope = self.config.rope_parameters
        inv_freq = rope_inv_freq(rope, head_dim_of(self.config), self.config_name)
        return mrope_cos_sin(inv_freq, position_ids, rope.get("mrope_section", DEFAULT_MROPE_SECTION), dtype)


class Qwen3VLModel(nn.Module):
    def __init__(self, config: PretrainedConfig, text_model_class: type[Qwen3TextModel]) -> None:
        super().__init__()
        self.visual = VisionModel(config.vision_config)
        self.language_model = text_model_class(config.text_config)


def video_frame_groups(video_grid_thw: GridThw | None) -> list[list[int]]:
    """A video's (T, H, W) as T grids (1, H, W): each group of temporal_patch_size frames has its own
    timestamp text and vision start/end tokens in input_ids, and is placed like an image of one frame."""
    return [[1, h, w] for t, h, w in grid_list(video_grid_thw) for _ in range(t)]


def mrope_position_ids(
    config: PretrainedConfig,
    input_ids: torch.Tensor,
    image_grid_thw: GridThw | None,
    cu_seqlens: torch.Tensor | None,
    video_grid_thw: GridThw | None = None,
) -> torch.Tensor:
    """(3, B, S) multimodal positions (t, h, w), restarting at 0 in every segment.

    Text tokens advance all three axes together. An image starting at position p spans
    t in p + [0, T), h in p + [0, H/merge), w in p + [0, W/merge); the text after it resumes at
    p + max(H, W) / merge. Images are taken from `image_grid_thw` in token order over the batch,
    video frame groups likewise from `video_grid_thw` (video_frame_groups).
    """
    image_token_id = config.image_token_id
    video_token_id = getattr(config, "video_token_id", None)
    merge = config.vision_config.spatial_merge_size
    batch, seq_len = input_ids.shape
    bounds = list(range(0, batch * seq_len + 1, seq_len)) if cu_seqlens is None else cu_seqlens.tolist()
    grids = {image_token_id: iter(grid_list(image_grid_thw))}
    if video_token_id is not None:
        grids[video_token_id] = iter(video_frame_groups(video_grid_thw))
    names = {image_token_id: "image tokens than image_grid_thw", video_token_id: "video tokens than video_grid_thw"}
    tokens = input_ids.flatten().tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        i = start
        pos = 0
        while i < end:
            if tokens[i] not in grids:
                j = i
                while j < end and tokens[j] not in grids:
                    j += 1
                out.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
                i = j
                continue
            grid = next(grids[tokens[i]], None)
            if grid is None:
                raise ValueError(f"input_ids has more {names[tokens[i]]} describes (at token {i})")
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out.append(torch.stack((tt, hh, ww)).flatten(1) + pos)
            pos += max(h, w)
            i += t * h * w
            if i > end:
                raise ValueError(f"an image of grid {grid} runs past the end of its segment ({end})")
    return torch.cat(out, dim=1).view(3, batch, seq_len).to(input_ids.device)


class VisionEmbeds:
    """The vision tower's output computed on other ranks (disjoint layouts, vlmcore.parallel.disjoint),
    which the model's forward takes instead of running its tower: the images', then the videos'
    embeddings, the DeepStack features as further columns.

    An object around the tensor, not the tensor as an argument: FSDP2 hooks the gradient of each
    tensor argument of a module's forward that requires grad (found by flattening tuples, lists
    and dicts) and reduce-scatters the module's gradients when it arrives. For these rows that
    would come before or after the bridge's all_to_all depending on whether the rank's micro-batch
    has images, and the ranks would wait in different collectives."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows


class Qwen3VLForConditionalGeneration(VisionLanguageParts, nn.Module):
    text_model_class = LanguageModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.head_dim = head_dim_of(text)
        self.model = Qwen3VLModel(config, self.text_model_class)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_weights()

    def position_ids(
        self,
        input_ids: torch.Tensor,
        image_grid_thw: GridThw | None = None,
        cu_seqlens: torch.Tensor | None = None,
        video_grid_thw: GridThw | None = None,
    ) -> torch.Tensor:
        return mrope_position_ids(self.config, input_ids, image_grid_thw, cu_seqlens, video_grid_thw)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: GridThw | None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: GridThw | None = None,
        visual_selection: Sequence[torch.Tensor] | None = None,
        vision_embeds: VisionEmbeds | None = None,
    ) -> tuple[torch.Tensor, VisualTokens | None, list[torch.Tensor]]:
        """Token embeddings with image and video features scattered in; also where they went
        (VisualTokens) and the DeepStack features. `vision_embeds`: the tower's output from other
        ranks, used instead of running the tower."""
        h = self.model.language_model.embed_tokens(input_ids)
        if pixel_values is None and pixel_values_videos is None:
            return h, None, []
        visual = VisualTokens(
            self.config, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, visual_selection
        )
        if vision_embeds is None:
            embeds, deepstack = self.model.visual(visual.pixels, visual.grids)
        else:
            embeds, *deepstack = vision_embeds.rows.split(self.config.vision_config.out_hidden_size, dim=1)
        return visual.scatter(h, embeds), visual, deepstack

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: GridThw | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        return_hidden: bool = False,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: GridThw | None = None,
        visual_selection: Sequence[torch.Tensor] | None = None,
        vision_embeds: VisionEmbeds | None = None,
        cache: ModelCache | None = None,
    ) -> ModelOutput:
        """`visual_selection`: under context parallelism (vlmcore.parallel.cp) input_ids is a chunk
        of the rows and this says which features of the images and videos go to it.
        `vision_embeds`: the tower's output from other ranks (`embed`). `cache`: generation's
        (vlmcore.generate), which gives the positions of the tokens it decodes."""
        h, visual, deepstack = self.embed(
            input_ids,
            pixel_values,
            image_grid_thw,
            pixel_values_videos,
            video_grid_thw,
            visual_selection,
            vision_embeds,
        )
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, cu_seqlens, video_grid_thw)
        h = self.model.language_model(h, position_ids, cu_seqlens, max_seqlen, visual, deepstack, cache=cache)
        return self.output(h, return_hidden)
