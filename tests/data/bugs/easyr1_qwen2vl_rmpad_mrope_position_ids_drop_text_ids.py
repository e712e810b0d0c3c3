# hiyouga/EasyR1#494: after transformers#40490, Qwen2-VL only reads packed-sequence boundaries from a 4th "text"
# row of position_ids; EasyR1's padding-free actor still passed (3, 1, nnz) mrope ids, so samples attended each other.
import sys

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = Qwen2VLConfig(
    text_config=dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    ),
    vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                       spatial_merge_size=1, temporal_patch_size=1, in_channels=3),
    image_token_id=60, video_token_id=61, vision_start_token_id=62, attn_implementation="sdpa",
)
model = Qwen2VLForConditionalGeneration(config).eval()


def process_position_ids(input_ids, attention_mask):
    """dataset side: qwen2vl mrope position ids (3, seq_len) from get_rope_index."""
    # get_rope_index: text-only samples get the same t/h/w index, counted over the attended tokens
    vision_position_ids = torch.clip(attention_mask.cumsum(-1) - 1, min=0).expand(3, -1)  # (3, seq_len)
    if FIXED:
        text_position_ids = torch.clip(attention_mask.cumsum(-1) - 1, min=0).unsqueeze(0)  # (1, seq_len)
        return torch.cat([text_position_ids, vision_position_ids], dim=0)  # (4, seq_len)
    return vision_position_ids


def unpad_input(hidden, attention_mask):
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    return hidden.flatten(0, 1)[indices], indices


def forward_micro_batch(input_ids, attention_mask, position_ids):
    """actor: padding-free (remove padding) forward, as in dp_actor._forward_micro_batch."""
    batch_size, seqlen = input_ids.shape
    input_ids_rmpad, indices = unpad_input(input_ids.unsqueeze(-1), attention_mask)  # (total_nnz, 1)
    input_ids_rmpad = input_ids_rmpad.transpose(0, 1)  # (1, total_nnz)
    if position_ids.dim() == 3:  # qwen2vl mrope: (bsz, c, seqlen) -> (c, 1, total_nnz)
        position_ids_rmpad = position_ids.transpose(1, 2).flatten(0, 1)[indices].transpose(0, 1).unsqueeze(1)
    else:
        position_ids_rmpad = position_ids.flatten()[indices].unsqueeze(0)
    output = model(input_ids=input_ids_rmpad, attention_mask=None, position_ids=position_ids_rmpad, use_cache=False)
    logits_rmpad = output.logits.squeeze(0)  # (total_nnz, vocab)
    logits = torch.zeros(batch_size * seqlen, logits_rmpad.size(-1))
    logits[indices] = logits_rmpad
    return logits.view(batch_size, seqlen, -1)


# two right-padded rollouts (prompt + response), text only
input_ids = torch.tensor([[1, 11, 12, 13, 14, 15, 2, 0], [1, 21, 22, 23, 24, 2, 0, 0]])
attention_mask = (torch.arange(8)[None] < torch.tensor([[7], [6]])).long()
position_ids = torch.stack([process_position_ids(i, m) for i, m in zip(input_ids, attention_mask)])
print("position_ids shape per batch:", tuple(position_ids.shape))

with torch.no_grad():
    logits = forward_micro_batch(input_ids, attention_mask, position_ids)
    ref = model(input_ids=input_ids[1:, :6], use_cache=False).logits[0]  # second sample alone
diff = (logits[1, :6] - ref).abs().max().item()
print(f"fixed={FIXED} sample 1 logits vs. running it alone: max diff {diff:.4f}")
