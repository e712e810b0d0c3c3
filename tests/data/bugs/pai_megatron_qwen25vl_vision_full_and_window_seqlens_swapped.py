# alibaba/Pai-Megatron-Patch#552: the Qwen2.5-VL vision model passed the per-frame cu_seqlens as the window-layer
# PackedSeqParams and the window cu_seqlens as packed_seq_params_full, so the full-attention blocks attended only
# inside windows and the windowed blocks attended across the whole frame (layer types swapped).
import sys
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, LAYERS = 32, 4, 4
FULLATT_BLOCK_INDEXES = [1, 3]
WINDOW = 2  # window side in (merged) patches


@dataclass
class PackedSeqParams:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    qkv_format: str = "thd"


class SelfAttention(nn.Module):
    """thd self-attention: each packed sub-sequence in cu_seqlens attends only to itself."""

    def __init__(self):
        super().__init__()
        self.linear_qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.linear_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, packed_seq_params):
        s = hidden_states.shape[0]
        q, k, v = self.linear_qkv(hidden_states[:, 0]).view(s, 3, HEADS, -1).permute(1, 2, 0, 3)
        cu = packed_seq_params.cu_seqlens_q
        seq_id = torch.bucketize(torch.arange(s), cu[1:], right=True)
        attention_mask = seq_id[:, None] == seq_id[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.linear_proj(out.transpose(0, 1).reshape(s, 1, HIDDEN))


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = SelfAttention()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.SiLU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, hidden_states, packed_seq_params):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states), packed_seq_params)
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer() for _ in range(LAYERS))

    def forward(self, hidden_states, packed_seq_params, packed_seq_params_full, fullatt_block_indexes):
        for i, layer in enumerate(self.layers):
            params = packed_seq_params_full if i in fullatt_block_indexes else packed_seq_params
            hidden_states = layer(hidden_states, params)
        return hidden_states


class Qwen2_5VisionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(12, HIDDEN)
        self.decoder = TransformerBlock()
        self.fullatt_block_indexes = FULLATT_BLOCK_INDEXES

    def get_window_index(self, grid_thw):
        window_index, cu_window_seqlens, window_index_id = [], [0], 0
        for t, h, w in grid_thw.tolist():
            index = torch.arange(t * h * w).reshape(t, h // WINDOW, WINDOW, w // WINDOW, WINDOW)
            window_index.append(index.permute(0, 1, 3, 2, 4).reshape(-1) + window_index_id)
            for _ in range(t * (h // WINDOW) * (w // WINDOW)):
                cu_window_seqlens.append(cu_window_seqlens[-1] + WINDOW * WINDOW)
            window_index_id += t * h * w
        return torch.cat(window_index), torch.tensor(cu_window_seqlens, dtype=torch.int32)

    def build_packed_seq_params(self, grid_thw, cu_seqlens=None):
        # NOTE: each frame is a sequence (rather than each grid)
        if grid_thw is not None:
            seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
            cu_seqlens = F.pad(seqlens.cumsum(dim=0), (1, 0), value=0).int()
        return PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)

    def forward(self, vision_data, grid_thw):
        vision_data = self.patch_embed(vision_data)
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        cu_window_seqlens = torch.unique_consecutive(cu_window_seqlens)
        vision_data = vision_data[window_index].unsqueeze(1)  # [s, b=1, h]
        if FIXED:
            packed, packed_full = self.build_packed_seq_params(None, cu_window_seqlens), self.build_packed_seq_params(grid_thw)
        else:
            packed, packed_full = self.build_packed_seq_params(grid_thw), self.build_packed_seq_params(None, cu_window_seqlens)
        hidden_states = self.decoder(vision_data, packed_seq_params=packed, packed_seq_params_full=packed_full,
                                     fullatt_block_indexes=self.fullatt_block_indexes)
        return hidden_states[torch.argsort(window_index), 0]


def reference(model, vision_data, grid_thw):
    """Per-layer masks written out directly: full blocks see the whole frame, the others one window."""
    x = model.patch_embed(vision_data)
    window_index, cu_window = model.get_window_index(grid_thw)
    x = x[window_index].unsqueeze(1)
    frame = model.build_packed_seq_params(grid_thw)
    window = model.build_packed_seq_params(None, cu_window)
    for i, layer in enumerate(model.decoder.layers):
        x = layer(x, frame if i in FULLATT_BLOCK_INDEXES else window)
    return x[torch.argsort(window_index), 0]


def main():
    model = Qwen2_5VisionModel().eval()
    grid_thw = torch.tensor([[2, 4, 4]])  # a two-frame video clip
    vision_data = torch.randn(32, 12)
    with torch.no_grad():
        out = model(vision_data, grid_thw)
        ref = reference(model, vision_data, grid_thw)
    print(f"{'fixed' if FIXED else 'buggy'}: max |out - reference| = {(out - ref).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
