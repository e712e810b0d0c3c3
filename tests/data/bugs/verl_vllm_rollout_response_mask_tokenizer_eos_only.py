# verl (verl-project/verl#213, fixing #212): the vLLM rollout builds response_attention_mask with get_eos_mask using
# only tokenizer.eos_token_id, but vLLM stops at any generation_config eos id; a response ending on another stop token
# keeps its right padding at mask 1, so the reward model reads its score from a pad instead of the last real token.
import sys
from typing import List, Union

import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD = 0
TOKENIZER_EOS = 2               # tokenizer.eos_token_id
GENERATION_CONFIG_EOS = [7, 2]  # generation_config.eos_token_id (what vLLM stops on)


def get_eos_mask(response_id: torch.Tensor, eos_token: Union[int, List[int]] = 2, dtype=torch.int64):
    '''
    response_id: [0, 0, 2, 42, 3, 5, 1, 0, 0]
    eos_mask:     [1, 1, 1, 1,  1, 1, 1, 0, 0]
    '''
    if FIXED:
        if isinstance(eos_token, int):
            eos_token = [eos_token]
        eos_mask = torch.zeros_like(response_id, dtype=torch.bool)
        for token in eos_token:
            eos_mask |= response_id.eq(token)
        eos_mask = eos_mask.long()
    else:
        eos_mask = response_id.eq(eos_token).long()
    eos_mask = (torch.cumsum(eos_mask, dim=1) - eos_mask).bool()
    eos_mask = torch.logical_not(eos_mask).to(dtype)
    return eos_mask


def pad_sequence_to_length(tensors, max_seq_len, pad_token_id, left_pad=False):
    if tensors.shape[-1] >= max_seq_len:
        return tensors
    pad_tuple = (max_seq_len - tensors.shape[-1], 0) if left_pad else (0, max_seq_len - tensors.shape[-1])
    return torch.nn.functional.pad(tensors, pad_tuple, 'constant', pad_token_id)


class FakeVLLMEngine:
    """Stands in for vLLM: returns the generated ids, stopped at the first generation_config eos id."""

    def __init__(self, outputs):
        self.outputs = outputs

    def generate(self, prompt_token_ids):
        resp = [torch.tensor(o) for o in self.outputs]
        max_len = max(len(r) for r in resp)
        return torch.stack([pad_sequence_to_length(r, max_len, PAD) for r in resp])


class vLLMRollout:
    def __init__(self, engine, response_length, pad_token_id):
        self.inference_engine = engine
        self.response_length = response_length
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate_sequences(self, prompts):
        idx = prompts['input_ids']  # (bs, prompt_length), left-padded
        attention_mask = prompts['attention_mask']
        position_ids = prompts['position_ids']
        # used to construct attention_mask
        eos_token_id = prompts['meta_info']['eos_token_id']
        batch_size = idx.size(0)

        idx_list = [idx[i][attention_mask[i].bool()].tolist() for i in range(batch_size)]
        response = self.inference_engine.generate(prompt_token_ids=idx_list)
        if response.shape[1] < self.response_length:
            response = pad_sequence_to_length(response, self.response_length, self.pad_token_id)

        seq = torch.cat([idx, response], dim=-1)
        response_length = response.size(1)
        delta_position_id = torch.arange(1, response_length + 1, device=position_ids.device)
        delta_position_id = delta_position_id.unsqueeze(0).repeat(batch_size, 1)
        response_position_ids = position_ids[:, -1:] + delta_position_id
        position_ids = torch.cat([position_ids, response_position_ids], dim=-1)
        response_attention_mask = get_eos_mask(response_id=response, eos_token=eos_token_id, dtype=attention_mask.dtype)
        attention_mask = torch.cat((attention_mask, response_attention_mask), dim=-1)
        return {'prompts': idx, 'responses': response, 'input_ids': seq, 'attention_mask': attention_mask,
                'position_ids': position_ids}


config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, num_labels=1,
                     initializer_range=0.2)
config._attn_implementation = "sdpa"
reward_module = Qwen2ForTokenClassification(config).eval()


def rm_forward_micro_batch(micro_batch):
    # RewardModelWorker._forward_micro_batch, use_remove_padding=False
    input_ids = micro_batch['input_ids']
    batch_size, seqlen = input_ids.shape
    attention_mask = micro_batch['attention_mask']
    position_ids = micro_batch['position_ids']
    with torch.no_grad():
        output = reward_module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    rm_score = output.logits.squeeze(-1)  # (batch_size, seq_len)
    # extract the result of the last valid token
    eos_mask_idx = torch.argmax(position_ids * attention_mask, dim=-1)  # (bsz,)
    return rm_score[torch.arange(batch_size), eos_mask_idx]


prompt_list = [[11, 12, 13, 14], [15, 16], [17, 18, 19]]
vllm_outputs = [[21, 22, 7], [23, 24, 25, 2], [26, 27, 28, 29, 7]]  # two responses stop on 7, one on 2
P = max(len(p) for p in prompt_list)
input_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompt_list])
attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_list])
pos = (attn.cumsum(-1) - 1).clamp(min=0)

# ActorRolloutRefWorker.generate_sequences meta_info
meta_info = {'eos_token_id': GENERATION_CONFIG_EOS if FIXED else TOKENIZER_EOS, 'pad_token_id': PAD}
rollout = vLLMRollout(FakeVLLMEngine(vllm_outputs), response_length=8, pad_token_id=PAD)
batch = rollout.generate_sequences({'input_ids': input_ids, 'attention_mask': attn, 'position_ids': pos,
                                    'meta_info': meta_info})
print("attention_mask:\n", batch['attention_mask'])
scores = rm_forward_micro_batch(batch)

# reference: each prompt + response (through its stop token) scored alone, reading the last token
max_diff = 0.0
for i, (p, r) in enumerate(zip(prompt_list, vllm_outputs)):
    ids = torch.tensor([p + r])
    with torch.no_grad():
        alone = reward_module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1, 0]
    max_diff = max(max_diff, (scores[i] - alone).abs().item())
print(f"max |rm_score(rollout batch) - rm_score(sequence alone)| = {max_diff:.6f}")
