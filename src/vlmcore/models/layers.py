"""Building blocks shared by the model families: norms, MLPs, rotary embeddings, image features, init."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

# Image or video grids, (t, h, w) per image: an (N, 3) tensor, or host ints as the training loop passes them.
GridThw = torch.Tensor | Sequence[Sequence[int]]


def grid_list(image_grid_thw: GridThw | None) -> list[list[int]]:
    """Image grids as host ints: a (N, 3) tensor (read once; a sync if it is on the GPU) or the
    list the training loop passes, which keeps them on the host."""
    if image_grid_thw is None:
        return []
    return image_grid_thw.tolist() if torch.is_tensor(image_grid_thw) else [list(g) for g in image_grid_thw]


class VisualTokens:
    """The images and videos of a batch, run through the vision tower in one pass (images first,
    then videos: each frame group attends only to itself, so the pass equals one per kind), and
    where the tower's output rows go: the image tokens, then the video tokens, each in order."""

    def __init__(
        self,
        config: PretrainedConfig,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: GridThw | None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: GridThw | None = None,
        selection: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """`selection`: context parallelism (vlmcore.data.load.batch.Batch.context_chunk): per kind, the
        indices of the tower's output rows at the tokens of `input_ids`, a chunk of the rows; None: all."""
        merge = config.vision_config.spatial_merge_size
        kinds = [
            ("image", config.image_token_id, pixel_values, grid_list(image_grid_thw)),
            ("video", getattr(config, "video_token_id", None), pixel_values_videos, grid_list(video_grid_thw)),
        ]
        kinds = [k for k in kinds if k[2] is not None]
        if any(token is None for _, token, _, _ in kinds):
            raise ValueError(f"{config.model_type} has no video_token_id: it takes no pixel_values_videos")
        self.pixels = torch.cat([px for _, _, px, _ in kinds]) if len(kinds) > 1 else kinds[0][2]
        self.grids = [g for *_, grids in kinds for g in grids]
        self.masks = [input_ids == token for _, token, _, _ in kinds]
        self.counts = [sum(t * h * w for t, h, w in grids) // merge**2 for *_, grids in kinds]
        self.kinds = [(kind, grids) for kind, _, _, grids in kinds]
        self.selection = selection

    def scatter(self, h: torch.Tensor, features: torch.Tensor, check: bool = True) -> torch.Tensor:
        """h with the tower's output rows (or a DeepStack level's) written at the visual tokens, in order.
        `check`: each kind's count of tokens must match its rows; checked on the host when h is there,
        and by a device-side assert on the GPU (a host check would stall it; the data loader has
        checked every sample already)."""
        parts = features.split(self.counts)
        if self.selection is not None:
            parts = [part.index_select(0, rows) for part, rows in zip(parts, self.selection)]
        for mask, part, (kind, grids) in zip(self.masks, parts, self.kinds):
            if check and h.device.type == "cpu":
                n_tokens = int(mask.sum())
                if n_tokens != part.shape[0]:
                    raise ValueError(
                        f"input_ids has {n_tokens} {kind} tokens but the {kind}s give {part.shape[0]} "
                        f"features ({kind}_grid_thw {grids})"
                    )
            elif check:
                torch._assert_async(
                    mask.sum() == part.shape[0],
                    f"input_ids and {kind}_grid_thw disagree on the number of {kind} tokens",
                )
            h = h.masked_scatter(mask[..., None], part.to(h.dtype))
        return h


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (as transformers' Qwen models do)."""

    init_value = 1.0  # of the weight

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), self.init_value))

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x), in fp32."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)

    def reset_own_parameters(self, std: float = 0.02) -> None:
        nn.init.constant_(self.weight, self.init_value)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose scale is `1 + weight` (weight initialised to 0), all in fp32 (Qwen3.5)."""

    init_value = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of x (B, S, H, D); cos/sin are (B, S, rot_dim).

    When rot_dim < D (partial rotary) the remaining channels pass through unchanged.
    """
    rot_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot


def rope_inv_freq(rope_parameters: dict, rot_dim: int, where: str, rope_type: str = "default") -> torch.Tensor:
    """Inverse frequencies of the plain (unscaled) RoPE over `rot_dim` channels."""
    if rope_parameters.get("rope_type", "default") != rope_type:
        raise ValueError(
            f"{where}: rope_type {rope_parameters.get('rope_type')!r} is not supported (only {rope_type!r})"
        )
    theta = rope_parameters["rope_theta"]
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, S, rot_dim) for plain 1-D positions (B, S)."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, mrope_section: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, S, rot_dim) for interleaved multimodal RoPE, position_ids (3, B, S) = (t, h, w).

    Frequency i is driven by the t position, except i = 1, 4, 7, ... (< 3 * section[1]) by h
    and i = 2, 5, 8, ... (< 3 * section[2]) by w.
    """
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # (3, B, S, rot/2)
    axis = torch.zeros(freqs.shape[-1], dtype=torch.long, device=freqs.device)
    axis[1 : 3 * mrope_section[1] : 3] = 1
    axis[2 : 3 * mrope_section[2] : 3] = 2
    freqs = torch.gather(freqs, 0, axis.expand(1, *freqs.shape[1:3], -1)).squeeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def head_dim_of(config: PretrainedConfig) -> int:
    """A text config's attention head size (`head_dim`, else hidden_size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def init_weights(model: nn.Module, std: float) -> None:
    """transformers' initialisation: N(0, std) weights for linears, convolutions and embeddings
    (zero padding row), zero biases, unit LayerNorms; vlmcore modules with parameters of their
    own (norms, Gated DeltaNet's decay) reset them in `reset_own_parameters`."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv3d)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif hasattr(m, "reset_own_parameters"):
            m.reset_own_parameters(std)


def init_std(config: PretrainedConfig) -> float:
    """The initializer_range transformers uses for a model of this config."""
    std = getattr(config, "initializer_range", None)
    if std is None and hasattr(config, "get_text_config"):
        std = getattr(config.get_text_config(), "initializer_range", None)
    return std or 0.02
