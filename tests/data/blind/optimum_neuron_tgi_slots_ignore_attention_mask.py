# huggingface/optimum-neuron#264 (commit 571effd8): the TGI NeuronGenerator called the model
# without the slots' attention masks, so left-padded slots attended to their pad tokens at
# prefill and at every decode step. Fix: keep a mask per slot and pass it to the model.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EOS = 0
VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2
BATCH_SIZE, MAX_LENGTH = 2, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.register_buffer("k_cache", torch.zeros(BATCH_SIZE, HEADS, MAX_LENGTH, DIM // HEADS))
        self.register_buffer("v_cache", torch.zeros(BATCH_SIZE, HEADS, MAX_LENGTH, DIM // HEADS))

    def forward(self, x, cache_ids, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        self.k_cache[:, :, cache_ids] = k
        self.v_cache[:, :, cache_ids] = v
        end = int(cache_ids[-1]) + 1
        y = F.scaled_dot_product_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.ln2(x))


class NeuronModelForCausalLM(nn.Module):
    """Stand-in for the compiled decoder: static batch, on-device KV cache, start_ids for left padding."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LENGTH, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.cur_len = 0

    def reset_generation(self):
        self.cur_len = 0

    def prepare_inputs_for_generation(self, input_ids, attention_mask: Optional[torch.Tensor] = None):
        # convert attention_mask to start_ids
        start_ids = None
        if attention_mask is not None:
            _, start_ids = attention_mask.max(axis=1)
        if self.cur_len > 0:
            input_ids = input_ids[:, -1:]
            cache_ids = torch.as_tensor([self.cur_len], dtype=torch.int64)
        else:
            cache_ids = torch.arange(input_ids.shape[-1], dtype=torch.int64)
        self.cur_len += input_ids.shape[-1]
        return {"input_ids": input_ids, "cache_ids": cache_ids, "start_ids": start_ids}

    def forward(self, input_ids, cache_ids, start_ids=None):
        key_pos = torch.arange(int(cache_ids[-1]) + 1)
        mask = (key_pos[None, :] <= cache_ids[:, None])[None, None]  # causal over the cache
        if start_ids is not None:  # keys before each line's first real token are padding
            mask = mask & (key_pos >= start_ids[:, None])[:, None, None, :]
        x = self.wte(input_ids) + self.wpe(cache_ids)[None]
        for block in self.blocks:
            x = block(x, cache_ids, mask)
        return self.lm_head(x)


class Slot:
    def __init__(self, id):
        self.id, self.tokens, self._mask, self.inputs = id, None, None, None

    def reset(self, input_ids, attention_mask):
        self.tokens = input_ids.clone()
        self._mask = attention_mask.clone()

    def append(self, next_token):
        self.tokens = torch.cat([self.tokens, torch.LongTensor([next_token])])
        self._mask = torch.cat([self._mask, torch.LongTensor([1])])

    @property
    def next_token(self):
        return self.tokens[-1]

    @property
    def attention_mask(self):
        return self._mask


class NeuronGenerator:
    def __init__(self, model, pad_id):
        self.model, self.pad_id = model, pad_id
        self.slots = [Slot(i) for i in range(BATCH_SIZE)]
        self.last_logits = None

    def _pad_left(self, inputs):
        length = max(len(t) for t in inputs)
        ids = torch.full((len(inputs), length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(inputs), length), dtype=torch.int64)
        for i, t in enumerate(inputs):
            ids[i, length - len(t):] = torch.tensor(t)
            mask[i, length - len(t):] = 1
        return ids, mask

    def prefill(self, requests):
        for slot, request in zip(self.slots, requests):
            slot.inputs = request
        input_ids, attention_mask = self._pad_left([slot.inputs for slot in self.slots])
        for i, slot in enumerate(self.slots):
            slot.reset(input_ids[i], attention_mask[i])
        self.model.reset_generation()
        if FIXED:
            return self._generate_token(input_ids, attention_mask)
        return self._generate_token(input_ids)

    def decode(self):
        input_ids = torch.full([BATCH_SIZE, 1], fill_value=EOS, dtype=torch.int64)
        attention_mask = torch.zeros([BATCH_SIZE, self.slots[0].attention_mask.size(-1)], dtype=torch.int64)
        for i, slot in enumerate(self.slots):
            input_ids[i, 0] = slot.next_token
            attention_mask[i, :] = slot.attention_mask
        return self._generate_token(input_ids, attention_mask if FIXED else None)

    @torch.no_grad()
    def _generate_token(self, input_ids, attention_mask=None):
        model_inputs = self.model.prepare_inputs_for_generation(input_ids, attention_mask)
        logits = self.model(**model_inputs)[:, -1, :]
        self.last_logits = logits
        for i, slot in enumerate(self.slots):
            slot.append(int(logits[i].argmax()))
        return logits


def serve(model, pad_id):
    gen = NeuronGenerator(model, pad_id)
    steps = [gen.prefill([[5, 9, 13, 2, 7, 30, 11, 3], [17, 4, 22]])]
    for _ in range(3):
        steps.append(gen.decode())
    return torch.stack(steps), gen.slots[1].tokens


model = NeuronModelForCausalLM().eval()
logits_a, tokens_a = serve(model, pad_id=EOS)
logits_b, tokens_b = serve(model, pad_id=EOS + 40)
# With a correct mask the short request's logits cannot depend on what its pad slots hold.
diff = (logits_a[:, 1] - logits_b[:, 1]).abs().max().item()
print(f"fixed={FIXED} slot-1 logits change with pad token id: {diff:.3e}")
print("slot-1 tokens:", tokens_a.tolist())
