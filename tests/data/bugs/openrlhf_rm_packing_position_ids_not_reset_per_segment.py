# OpenRLHF/OpenRLHF commit b2e226f ("reset packing position ids"), openrlhf/models/model.py _get_reward_model.
# Bug: with packing_samples the segment-id attention_mask [1,1,1,2,2,2,...] is turned into position_ids by a
# running cumsum over the whole row, so every packed chosen/rejected sample after the first gets shifted positions.
import sys
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def reset_position_ids(attention_mask):
    position_ids = torch.zeros_like(attention_mask, dtype=torch.long)
    for i in range(attention_mask.size(0)):
        mask = attention_mask[i]
        seq_num = mask.max().item()
        for index in range(1, seq_num + 1):
            sample_mask = mask == index
            sample_length = sample_mask.sum().item()
            position_ids[i, sample_mask] = torch.arange(sample_length, device=mask.device)
    return position_ids


def packed_4d_mask(attention_mask):
    """CPU stand-in for OpenRLHF's patched flash-attn varlen path (_get_unpad_data reads segment ids from
    attention_mask): block-diagonal causal attention per packed sample, as an additive float mask."""
    L = attention_mask.size(1)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    seg = attention_mask
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal & (seg[:, None, :] != 0)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


class RewardModel(nn.Module):
    base_model_prefix = "transformer"

    def __init__(self, config, packing_samples=True):
        super().__init__()
        setattr(self, self.base_model_prefix, GPT2Model(config))
        self.value_head_prefix = "value_head"
        setattr(self, self.value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
        self.packing_samples = packing_samples

    def forward(self, input_ids, attention_mask=None, return_output=False):
        if not self.packing_samples:
            # https://github.com/OpenRLHF/OpenRLHF/issues/217
            position_ids = attention_mask.long().cumsum(-1) - 1
        else:
            if FIXED:
                # reset the positions for packed samples
                position_ids = reset_position_ids(attention_mask)
            else:
                # TODO: reset the positions for packed samples, there's no need to do this for RoPE at the moment.
                position_ids = (attention_mask != 0).long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        attn = packed_4d_mask(attention_mask) if self.packing_samples else attention_mask
        outputs = getattr(self, self.base_model_prefix)(input_ids, attention_mask=attn, position_ids=position_ids)
        last_hidden_states = outputs["last_hidden_state"]
        values = getattr(self, self.value_head_prefix)(last_hidden_states).squeeze(-1)
        reward = values  # return all values for packing_samples
        return (reward, outputs) if return_output else reward


def packed_samples_forward(model, packed_input_ids, packed_attention_masks, packed_seq_lens):
    all_values, output = model(packed_input_ids, attention_mask=packed_attention_masks, return_output=True)
    half_len = len(packed_seq_lens) // 2
    rewards = []
    index = 0
    for i, seq_len in enumerate(packed_seq_lens):
        index = index + seq_len
        rewards.append(all_values[0, index - 1])
    rewards = torch.stack(rewards)
    return rewards[:half_len], rewards[half_len:]


cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
cfg._attn_implementation = "eager"
model = RewardModel(cfg).eval()

g = torch.Generator().manual_seed(1)
rnd = lambda n: torch.randint(3, 64, (n,), generator=g).tolist() + [2]
chosen = [rnd(6), rnd(4)]
rejected = [rnd(3), rnd(7)]
samples = chosen + rejected  # RewardDataset packing_collate_fn: chosen first, then rejected
packed_input_ids, packed_attention_masks, packed_seq_lens = [], [], []
for idx, s in enumerate(samples):
    packed_input_ids += s
    packed_attention_masks += [idx + 1] * len(s)
    packed_seq_lens.append(len(s))
packed_input_ids = torch.tensor([packed_input_ids])
packed_attention_masks = torch.tensor([packed_attention_masks])

with torch.no_grad():
    chosen_r, rejected_r = packed_samples_forward(model, packed_input_ids, packed_attention_masks, packed_seq_lens)
    # reference: each sample alone through the unpacked path
    model.packing_samples = False
    alone = []
    for s in samples:
        ids = torch.tensor([s])
        alone.append(model(ids, attention_mask=torch.ones_like(ids))[0, -1])
    alone = torch.stack(alone)

packed = torch.cat([chosen_r, rejected_r])
print("packed rewards:", [round(x, 5) for x in packed.tolist()])
print(f"max |packed reward - each sample alone|: {(packed - alone).abs().max().item():.6e}")
