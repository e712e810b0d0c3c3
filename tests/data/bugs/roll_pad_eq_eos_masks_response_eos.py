# alibaba/ROLL#304: get_pad_mask builds the response attention mask as response != pad_token; for Qwen3 base
# models eos == pad, so the real eos that ends each response is masked out of the actor/critic forward.
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_TOKEN_ID = EOS_TOKEN_ID = 3  # qwen3 base: <|endoftext|> is both eos and pad


def get_pad_mask(response_id, pad_token=0, eos_token=1, dtype=torch.int64):
    """
    e.g. pad token=0
    response_id: [1, 2, 2, 42, 3, 5, 1, 0, 0]
    pad_mask:     [1, 1, 1, 1,  1, 1, 1, 0, 0]
    """
    pad_mask = response_id.not_equal(pad_token).to(dtype)
    if FIXED and eos_token == pad_token:
        # keep the first pad token, it is the eos token
        pad_positions = response_id.eq(pad_token).to(dtype)
        cumsum_pad = torch.cumsum(pad_positions, dim=-1)
        first_pad_token = (cumsum_pad == 1).to(dtype)
        pad_mask = pad_mask | first_pad_token
    assert not (pad_mask[:, 0] == 0).logical_and(pad_mask.sum(-1) != 0).any()
    return pad_mask


def pad_to_length(tensor, length, pad_value):
    if tensor.size(-1) >= length:
        return tensor
    pad = torch.full((tensor.size(0), length - tensor.size(-1)), pad_value, dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=-1)


def postprocess_generate(input_ids, attention_mask, output, sequence_length):
    """After rollout: split prompt / response, build attention_mask and position_ids for training."""
    prompt_length = input_ids.size(1)
    output = pad_to_length(output, sequence_length, PAD_TOKEN_ID)
    response = output[:, prompt_length:].clone()
    response_mask = get_pad_mask(
        response_id=response, pad_token=PAD_TOKEN_ID, eos_token=EOS_TOKEN_ID, dtype=attention_mask.dtype
    )
    attention_mask = torch.cat((attention_mask, response_mask), dim=-1)
    position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return output, attention_mask, position_ids, response_mask


config = Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=PAD_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID, attn_implementation="sdpa",
)
actor = Qwen3ForCausalLM(config).eval()
value_head = torch.nn.Linear(config.hidden_size, 1)

# two left-padded prompts
input_ids = torch.tensor([[3, 3, 11, 12, 13], [21, 22, 23, 24, 25]])
prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
# rollout output: prompt + response that ends with eos, then pad (same id)
output = torch.cat([
    pad_to_length(torch.tensor([[3, 3, 11, 12, 13, 40, 41, 42, EOS_TOKEN_ID]]), 12, PAD_TOKEN_ID),
    pad_to_length(torch.tensor([[21, 22, 23, 24, 25, 50, 51, EOS_TOKEN_ID]]), 12, PAD_TOKEN_ID),
])
seqs, attention_mask, position_ids, response_mask = postprocess_generate(input_ids, prompt_mask, output, 12)
print("attention_mask:", attention_mask.tolist())

with torch.no_grad():
    out = actor(input_ids=seqs, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=True)
    values = value_head(out.hidden_states[-1]).squeeze(-1)

# the critic's value at the eos token (the last response token the reward is attached to)
eos_pos = [8, 7]
v_eos = torch.stack([values[b, p] for b, p in enumerate(eos_pos)])
# reference: each sequence alone, unpadded, eos visible
ref = []
with torch.no_grad():
    for b, p in enumerate(eos_pos):
        keep = seqs[b, : p + 1][prompt_mask[b].bool().tolist() + [True] * (p + 1 - 5)]
        h = actor(input_ids=keep[None], output_hidden_states=True).hidden_states[-1]
        ref.append(value_head(h)[0, -1, 0])
ref = torch.stack(ref)
print(f"fixed={FIXED} response_mask at eos: {[int(response_mask[b, p - 5]) for b, p in enumerate(eos_pos)]}")
print(f"value at eos: {v_eos.tolist()}  reference: {ref.tolist()}  max diff {float((v_eos - ref).abs().max()):.4f}")
