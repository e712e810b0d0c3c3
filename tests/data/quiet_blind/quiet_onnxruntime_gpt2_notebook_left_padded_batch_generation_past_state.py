"""GPT-2 batch text generation with past state, as onnxruntime's GPT-2 tutorial and helper write it.

Ported from microsoft/onnxruntime (the PyTorch side of the tutorial; no ONNX export, no session):
  onnxruntime/python/tools/transformers/notebooks/Inference_GPT2_with_OnnxRuntime_on_CPU.ipynb
      @424107a82a9aa018f2925406b34a39b11d1e02e8
    get_tokenizer      -- padding_side = "left", pad_token = eos_token
    get_example_inputs -- position_ids = attention_mask.long().cumsum(-1) - 1, masked_fill_(< 0, 0),
                          an empty past [2, batch, heads, 0, head_size] per layer
    test_generation    -- greedy loop: input_ids = the new token, position_ids = position_ids[:, -1] + 1,
                          attention_mask grown by a column of ones, past = the presents; rows that
                          produced eos keep feeding eos
  onnxruntime/python/tools/transformers/models/gpt2/gpt2_helper.py
      @39f1ce51bad5767a6f0ad38d397e49c8a4ed0943
    MyGPT2LMHeadModel.forward(input_ids, position_ids, attention_mask, *past) and
    MyGPT2Model.post_process (key and value of each layer stacked into one present [2, B, H, T, D]);
    Gpt2Helper.get_dummy_inputs (random left padding, positions deduced from the mask and sliced
    past the past length).
The model is transformers' GPT2LMHeadModel (learned position table wpe), tiny, built from GPT2Config.
transformers 5 takes a Cache object rather than a tuple, so the wrapper hands the stacked past over as a
DynamicCache and stacks it back on the way out; the tensors the loop carries are those of the helper.
At this commit the notebook's test_generation asserts batch_size == 1; the loop itself is the batched
one (has_eos per row, tokens masked by it), run here on a left-padded batch of four prompts (the
notebook's two example prompts plus two shorter ones).

Checks, against a reference written here: each prompt decoded alone, unpadded, without any past
(the whole sequence recomputed every step, default positions 0..n-1) gives the same tokens and the
same step logits as its row of the padded, cached batch; the first (prefill) logits on real tokens
also match; get_dummy_inputs' random left-padded past/inputs give the same last-token logits as the
unpadded rows recomputed from scratch.
"""
import random

import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

EOS = 0
# "best hotel in bay area", "here is an example of gpt2 model" as toy token ids (shorter first)
EXAMPLE_Text = [[17, 23, 5, 41, 9], [12, 30, 8, 27, 44, 3, 36, 19, 25]]
EXTRA_Text = [[7], [33, 14, 2]]


class MyGPT2Model:
    @staticmethod
    def post_process(result, num_layer):
        cache = result[1]
        present = []
        for i in range(num_layer):
            # key and value of a layer concatenated into one tensor, as the Attention operator takes it
            layer = cache.layers[i]
            present.append(torch.cat((layer.keys.unsqueeze(0), layer.values.unsqueeze(0)), dim=0))
        return (result[0], tuple(present))


class MyGPT2LMHeadModel(GPT2LMHeadModel):
    """Here we wrap a class for Onnx model conversion for GPT2LMHeadModel with past state."""

    def __init__(self, config):
        super().__init__(config)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        cache = DynamicCache(config=self.config)
        for i, past_i in enumerate(past):
            if past_i.size(3) > 0:
                cache.update(past_i[0], past_i[1], i)
        result = super().forward(
            input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            return_dict=False,
        )
        return MyGPT2Model.post_process(result, self.config.n_layer)


def build():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    model = MyGPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6.0)
    return model


def batch_encode_plus(prompt_text, pad_token_id):
    """The tokenizer's padding=True with padding_side = "left"."""
    longest = max(len(t) for t in prompt_text)
    input_ids = [[pad_token_id] * (longest - len(t)) + t for t in prompt_text]
    attention_mask = [[0] * (longest - len(t)) + [1] * len(t) for t in prompt_text]
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def get_example_inputs(model, prompt_text=EXAMPLE_Text):
    config = model.config
    num_attention_heads, hidden_size, num_layer = config.n_head, config.n_embd, config.n_layer
    encodings_dict = batch_encode_plus(prompt_text, pad_token_id=config.eos_token_id)

    input_ids = torch.tensor(encodings_dict["input_ids"], dtype=torch.int32)
    attention_mask = torch.tensor(encodings_dict["attention_mask"], dtype=torch.int32)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(position_ids < 0, 0)
    position_ids = position_ids.to(torch.int32)

    # Empty Past State for generating first word
    empty_past = []
    batch_size = input_ids.size(0)
    past_shape = [2, batch_size, num_attention_heads, 0, hidden_size // num_attention_heads]
    for i in range(num_layer):
        empty_past.append(torch.empty(past_shape).type(torch.float32))

    return input_ids, attention_mask, position_ids, empty_past


@torch.no_grad()
def test_generation(model, input_text, num_tokens_to_produce=8):
    eos_token_id = model.config.eos_token_id

    input_ids, attention_mask, position_ids, past = get_example_inputs(model, input_text)
    batch_size = input_ids.size(0)

    has_eos = torch.zeros(batch_size, dtype=torch.bool)

    all_token_ids = input_ids.clone()
    step_logits = []

    for step in range(num_tokens_to_produce):
        outputs = model(input_ids.long(), position_ids.long(), attention_mask, *past)

        next_token_logits = outputs[0][:, -1, :]
        step_logits.append(next_token_logits)
        # Greedy approach is used here.
        next_tokens = torch.argmax(next_token_logits, dim=-1)

        has_eos = has_eos | (next_tokens == eos_token_id)
        tokens_to_add = next_tokens.masked_fill(has_eos, eos_token_id)
        all_token_ids = torch.cat([all_token_ids, tokens_to_add.unsqueeze(-1).to(all_token_ids.dtype)], dim=-1)

        # Update input_ids, attention_mask, position_ids and past
        input_ids = tokens_to_add.clone().detach().reshape([batch_size, 1])
        position_ids = (position_ids[:, -1] + 1).reshape(batch_size, 1)
        attention_mask = torch.cat([attention_mask, torch.ones([batch_size, 1]).type_as(attention_mask)], 1)

        past = list(outputs[1])

        if torch.all(has_eos):
            break

    return all_token_ids, step_logits


def get_dummy_inputs(batch_size, past_sequence_length, sequence_length, num_attention_heads, hidden_size,
                     num_layer, vocab_size, left_side_padding=True):
    """Gpt2Helper.get_dummy_inputs, with the past taken from a real prefill instead of torch.rand."""
    input_ids = torch.randint(low=0, high=vocab_size - 1, size=(batch_size, past_sequence_length + sequence_length),
                              dtype=torch.int32)
    total_sequence_length = past_sequence_length + sequence_length
    attention_mask = torch.ones([batch_size, total_sequence_length], dtype=torch.int32)
    if total_sequence_length >= 2:
        for i in range(batch_size):
            padding_length = random.randint(0, past_sequence_length)
            if left_side_padding:
                attention_mask[i, :padding_length] = 0
            else:  # right side padding
                attention_mask[i, total_sequence_length - padding_length:] = 0

    # Deduce position_ids from attention mask
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(position_ids < 0, 0)
    return input_ids, position_ids.to(torch.int32), attention_mask


@torch.no_grad()
def reference_greedy(model, prompt, num_tokens_to_produce):
    """One prompt, no padding, no past: the whole sequence recomputed each step."""
    eos_token_id = model.config.eos_token_id
    tokens = list(prompt)
    logits, generated = [], []
    ended = False
    for _ in range(num_tokens_to_produce):
        ids = torch.tensor([tokens])
        out = GPT2LMHeadModel.forward(model, ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
        logits.append(out)
        nxt = int(out.argmax())
        ended = ended or nxt == eos_token_id
        nxt = eos_token_id if ended else nxt
        generated.append(nxt)
        tokens.append(nxt)
    return generated, logits


def main():
    model = build()
    n_new = 8
    prompts = EXAMPLE_Text + EXTRA_Text

    # prefill logits of the padded batch vs each prompt alone (only real tokens compared, as the notebook does)
    input_ids, attention_mask, position_ids, empty_past = get_example_inputs(model, prompts)
    with torch.no_grad():
        out = model(input_ids.long(), position_ids.long(), attention_mask, *empty_past)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        with torch.no_grad():
            alone = GPT2LMHeadModel.forward(model, torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long)).logits[0]
        err = (out[0][b, -n:] - alone).abs().max().item()
        assert err < 1e-4, (b, err)
    print("prefill logits on real tokens match each prompt alone")

    all_token_ids, step_logits = test_generation(model, prompts, num_tokens_to_produce=n_new)
    width = input_ids.size(1)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference_greedy(model, prompt, len(step_logits))
        got = all_token_ids[b, width:].tolist()
        assert got == ref_tokens, (b, got, ref_tokens)
        for s, ref in enumerate(ref_logits):
            if s > 0 and ref_tokens[s - 1] == model.config.eos_token_id:
                break
            err = (step_logits[s][b] - ref).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, (b, s, err)
        print(f"row {b}: prompt {prompt} -> {got}")
    print(f"batched cached generation matches per-prompt recompute (max logit err {worst:.2e})")

    # Gpt2Helper.get_dummy_inputs: random left padding, then one step with a past of the padded prefix
    random.seed(1)
    torch.manual_seed(1)
    cfg = model.config
    past_len, seq_len = 6, 1
    ids, pos, mask = get_dummy_inputs(3, past_len, seq_len, cfg.n_head, cfg.n_embd, cfg.n_layer, cfg.vocab_size)
    empty = [torch.empty(2, 3, cfg.n_head, 0, cfg.n_embd // cfg.n_head) for _ in range(cfg.n_layer)]
    with torch.no_grad():
        _, past = model(ids[:, :past_len].long(), pos[:, :past_len].long(), mask[:, :past_len], *empty)
        logits, _ = model(ids[:, past_len:].long(), pos[:, past_len:].long(), mask, *past)
    for b in range(3):
        real = ids[b][mask[b].bool()].long().unsqueeze(0)
        with torch.no_grad():
            ref = GPT2LMHeadModel.forward(model, real, attention_mask=torch.ones_like(real)).logits[0, -1]
        err = (logits[b, -1] - ref).abs().max().item()
        assert err < 1e-4, (b, err)
    print("get_dummy_inputs' left-padded past step matches unpadded recompute")


if __name__ == "__main__":
    main()
