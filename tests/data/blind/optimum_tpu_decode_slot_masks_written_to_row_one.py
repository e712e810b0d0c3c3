# Citation: huggingface/optimum-tpu#8 (commit fecab96), reverting commit dc15e65
#   ("fix: attention mask should be 1 or 0").
# Upstream: text-generation-inference/server/text_generation_server/generator.py,
#   TpuGenerator.decode (TGI's slot-based generator ported to PyTorch/XLA on TPU); Slot,
#   TpuGenerator.prefill / _generate_token / _post_generate read at fecab96^.
# Bug: on the dynamic-cache path (models without `_setup_cache`, so no static cache) decode
#   rebuilds the batched [batch_size, kv_len] attention mask from the slots with
#   `attention_mask.index_put_([torch.tensor([1])], slot.attention_mask)`: every slot's mask is
#   written into row 1, so row 0 keeps an all-zero mask (and row 1 gets the last slot's mask).
# Fix: `attention_mask.index_put_([torch.tensor([i])], slot.attention_mask)`.
# torch_xla's xm.mark_step and the TGI protobuf types are left out (no-ops / plain objects);
# the model is a tiny randomly initialised transformers LlamaForCausalLM on CPU, eager attention.
import sys
import copy
from enum import Enum

import warnings

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, GenerationConfig

warnings.filterwarnings("ignore", category=FutureWarning)
transformers.logging.set_verbosity_error()

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ToyTokenizer:
    """Stands in for the HF tokenizer: text is space-separated token ids; pads on the left."""

    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id
        self.padding_side = "left"
        self.all_special_ids = [eos_token_id]

    def encode(self, text):
        return [int(t) for t in text.split()]

    def __call__(self, texts, return_tensors="pt", padding=True):
        ids = [self.encode(t) for t in texts]
        width = max(len(x) for x in ids)
        input_ids, mask = [], []
        for x in ids:
            n = width - len(x)
            input_ids.append([self.pad_token_id] * n + x)
            mask.append([0] * n + [1] * len(x))

        class Enc(dict):
            def to(self, device):
                return self

        enc = Enc(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(mask))
        enc.input_ids = enc["input_ids"]
        enc.attention_mask = enc["attention_mask"]
        return enc

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(" %d" % int(t) for t in tokens)


class Request:
    def __init__(self, id, inputs, max_new_tokens):
        self.id = id
        self.inputs = inputs
        self.max_new_tokens = max_new_tokens


class GreedySelector:
    def __init__(self, max_length):
        self.max_length = max_length

    def select(self, input_ids, logits):
        return logits.argmax(-1)

    def stopping_criteria(self, tokens, scores):
        return tokens.numel() >= self.max_length


class Slot:
    class State(Enum):
        EMPTY = 0
        PAUSE = 1
        READY = 2

    def __init__(self, id: int, tokenizer, device):
        self._id = id
        self._tokenizer = tokenizer
        self._device = device
        self.clear()

    def clear(self):
        self._state = Slot.State.EMPTY
        self._request_id = None
        self._inputs = ""
        self._generation_config = None
        self._tokens = []
        self._mask = []
        self._selector = None
        self._generated_tokens = 0
        self._next_text_token_start = 0
        self._next_text_token_end = 0
        self._generated_text = ""
        self._next_text = ""

    @property
    def id(self):
        return self._id

    @property
    def state(self):
        return self._state

    @property
    def request_id(self):
        return self._request_id

    @property
    def cached_text(self):
        return self._inputs + self._generated_text

    @property
    def generation_config(self):
        return self._generation_config

    @property
    def cur_position(self):
        return self._next_text_token_start

    def assign(self, request, generation_config):
        self._state = Slot.State.READY
        self._request_id = request.id
        self._inputs = request.inputs
        self._generation_config = copy.deepcopy(generation_config)
        self._generation_config.max_new_tokens = request.max_new_tokens

    def reset(self, input_ids, attention_mask, selector):
        self._tokens = input_ids.cpu()
        self._next_text_token_start = 0
        self._next_text_token_end = torch.numel(self._tokens)
        self._next_text = ""
        if attention_mask is not None:
            self._mask = attention_mask.clone()
        else:
            self._mask = None
        self._selector = selector

    def _decode_next_tokens(self):
        tokens = self._tokens.cpu()
        new_text = self._tokenizer.decode(tokens[self._next_text_token_start:], skip_special_tokens=False)
        last_text = self._tokenizer.decode(
            tokens[self._next_text_token_start:self._next_text_token_end], skip_special_tokens=False
        )
        if len(new_text) == len(last_text):
            return ""
        self._next_text_token_start = self._next_text_token_end
        self._next_text_token_end = torch.numel(tokens)
        return new_text[len(last_text):]

    def append(self, next_token: int) -> str:
        self._tokens = torch.cat([self._tokens, torch.tensor([next_token], dtype=self._tokens.dtype)])
        # Update mask only if it was set previously
        if self._mask is not None:
            self._mask = torch.cat([self._mask, torch.tensor([1], device=self._device, dtype=self._mask.dtype)])
        self._generated_tokens += 1
        next_text = self._decode_next_tokens()
        self._generated_text += self._next_text
        self._next_text = next_text
        return next_text

    def select(self, input_ids, logits):
        return self._selector.select(input_ids, logits)[0]

    @property
    def stopped(self):
        return self._selector.stopping_criteria(self._tokens, None)

    @property
    def generated_text(self):
        return self._generated_text + self._next_text

    @property
    def next_token(self):
        return None if len(self._tokens) == 0 else self._tokens[-1]

    @property
    def attention_mask(self):
        return self._mask


class TpuGenerator:
    def __init__(self, model, tokenizer):
        self.model = model
        tokenizer.pad_token_id = tokenizer.eos_token_id
        tokenizer.padding_side = "left"
        self.tokenizer = tokenizer
        self.special_tokens = self.tokenizer.all_special_ids
        self.slots = [Slot(i, tokenizer, self.model.device) for i in range(self.model.config.batch_size)]
        self.past_key_values = None
        self.use_static_cache = True
        if getattr(self.model, "_setup_cache", False) is False:
            self.use_static_cache = False
        self.model_one_token = model

    @torch.no_grad()
    def prefill(self, requests):
        slots = {state: [] for state in Slot.State}
        for slot in self.slots:
            slots[slot.state].append(slot)
        active_slots = slots[Slot.State.READY]
        empty_slots = slots[Slot.State.EMPTY]
        for request in requests:
            slot = empty_slots.pop()
            slot.assign(request, self.model.generation_config)
        inputs = [slot.cached_text for slot in self.slots]
        padded_inputs = self.tokenizer(inputs, return_tensors="pt", padding=True).to(self.model.device)
        seq_length = min(padded_inputs.input_ids.shape[-1], self.model.config.sequence_length)
        input_ids = padded_inputs.input_ids[:, :seq_length]
        attention_mask = padded_inputs.attention_mask[:, :seq_length]
        next_tokens = []
        for slot in active_slots:
            next_tokens.append(slot.next_token)
        for i, slot in enumerate(self.slots):
            if slot.state != slot.state.EMPTY:
                slot_input_ids = input_ids[i:i + 1, :]
                selector = GreedySelector(slot_input_ids.shape[-1] + slot.generation_config.max_new_tokens)
                slot_input_ids = slot_input_ids.squeeze(dim=0).type(torch.int64)
                if self.use_static_cache:
                    slot_attention_mask = None
                else:
                    slot_attention_mask = attention_mask[i]
                slot.reset(slot_input_ids, slot_attention_mask, selector)
        self.past_key_values = None
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        return self._generate_token(0, input_ids, self.model, attention_mask=attention_mask,
                                    position_ids=position_ids)

    @torch.no_grad()
    def decode(self, batch_id):
        input_ids = None
        attention_mask = None
        position_ids = torch.zeros([self.model.config.batch_size, 1], dtype=torch.int64, device=self.model.device)
        for i, slot in enumerate(self.slots):
            if slot.state != Slot.State.EMPTY:
                if input_ids is None:
                    input_ids = torch.full([self.model.config.batch_size, 1],
                                           fill_value=self.tokenizer.eos_token_id,
                                           dtype=torch.int64, device=self.model.device)
                input_ids.index_put_([torch.tensor([i])], slot.next_token)
                if not self.use_static_cache:
                    if attention_mask is None:
                        attention_mask = torch.zeros([self.model.config.batch_size, slot.attention_mask.size(-1)],
                                                     dtype=torch.int64, device=self.model.device)
                    if FIXED:
                        attention_mask.index_put_([torch.tensor([i])], slot.attention_mask)
                    else:
                        attention_mask.index_put_([torch.tensor([1])], slot.attention_mask)
                position_ids.index_put_([torch.tensor([i])], torch.tensor(slot.cur_position))
        extra_args = {}
        if self.use_static_cache:
            extra_args["cache_position"] = position_ids.max().unsqueeze(0)
        else:
            extra_args["attention_mask"] = attention_mask
            extra_args["past_key_values"] = self.past_key_values
        return self._generate_token(batch_id, input_ids, self.model_one_token, position_ids=position_ids,
                                    **extra_args)

    def _generate_token(self, next_batch_id, input_ids, model, **forward_extra_params):
        outputs = model(input_ids, return_dict=True, use_cache=True, **forward_extra_params)
        if not self.use_static_cache:
            self.past_key_values = outputs.past_key_values
        return self._post_generate(outputs, next_batch_id, input_ids)

    def _post_generate(self, outputs, next_batch_id, input_ids):
        generations = []
        for i, slot in enumerate(self.slots):
            if slot.state != Slot.State.READY:
                continue
            next_token_logits = outputs.logits[i:i + 1, -1, :]
            slot_input_ids = input_ids[i:i + 1, :]
            next_token = slot.select(slot_input_ids, next_token_logits)
            slot.append(next_token)
            generations.append((slot.request_id, int(next_token), next_token_logits[0, :4].tolist()))
        return generations


def main():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.config.batch_size = 2
    model.config.sequence_length = 32
    model.generation_config = GenerationConfig(max_new_tokens=8)
    tokenizer = ToyTokenizer(eos_token_id=2)
    generator = TpuGenerator(model, tokenizer)

    # Two concurrent requests of different lengths; the shorter prompt is left padded.
    requests = [Request(0, "1 17 23 41 8 30 12 55 9", max_new_tokens=5),
                Request(1, "1 44 6 19", max_new_tokens=5)]
    out = generator.prefill(requests)
    print("prefill:", [(r, t) for r, t, _ in out])
    print("slot masks:", [s.attention_mask.tolist() for s in generator.slots])
    for step in range(4):
        out = generator.decode(0)
        print("decode step %d:" % step, [(r, t, [round(v, 4) for v in lg]) for r, t, lg in out])
    for s in generator.slots:
        print("request %d generated:%s" % (s.request_id, s.generated_text))


if __name__ == "__main__":
    main()
