"""DialoGPT multi-turn batch: turns joined by <|endoftext|>, and the batch padded with that same id on the left.

Follows microsoft/DialoGPT's interaction recipe (https://github.com/microsoft/DialoGPT README "Interact with the
model": ``chat_history_ids = torch.cat([chat_history_ids, new_user_input_ids], dim=-1)`` where every turn is encoded
as ``tokenizer.encode(text + tokenizer.eos_token)``, then ``model.generate(..., pad_token_id=tokenizer.eos_token_id)``)
and transformers' batched decoder-only generation (``tokenizer.padding_side = "left"``, ``pad_token = eos_token``),
with GPT2LMHeadModel built from a small GPT2Config with random weights.

Mask meant: causal over each row, plus the attention_mask that the tokenizer's padding produces: the LEFT pad
positions are hidden, while the EOS ids *inside* the history are real turn separators and stay visible. The pad
id equals the eos id on purpose, so the mask comes from the lengths, never from ``input_ids == eos``.
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

EOS = 50  # stands for <|endoftext|> (50256) in the real vocabulary


def encode_dialog(turns):
    ids = []
    for turn in turns:
        ids.extend(turn + [EOS])  # tokenizer.encode(text + tokenizer.eos_token)
    return ids


def left_pad(batch_ids, pad_token_id):
    """What tokenizer(..., padding=True) does with padding_side='left'."""
    width = max(len(x) for x in batch_ids)
    input_ids = torch.full((len(batch_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch_ids), width), dtype=torch.long)
    for i, ids in enumerate(batch_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    return input_ids, attention_mask


def main():
    hf_logging.set_verbosity_error()  # the pad==eos advisory is expected here; the masks are passed
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).eval()

    dialogs = [
        [[3, 4, 5], [6, 7], [8, 9, 10, 11]],  # user / bot / user: three EOS separators
        [[12, 13]],                            # a single user turn
        [[14], [15, 16, 17, 18, 19], [20]],
    ]
    batch_ids = [encode_dialog(d) for d in dialogs]
    input_ids, attention_mask = left_pad(batch_ids, pad_token_id=EOS)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        # Reference: each dialog alone, unpadded, so it sees exactly its own tokens causally.
        for i, ids in enumerate(batch_ids):
            ones = torch.ones(1, len(ids), dtype=torch.long)
            alone = model(input_ids=torch.tensor([ids]), attention_mask=ones).logits[0]
            assert torch.allclose(logits[i, -len(ids):], alone, atol=1e-4), i

        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, min_new_tokens=2,
                             do_sample=False, pad_token_id=EOS)
        for i, ids in enumerate(batch_ids):
            ones = torch.ones(1, len(ids), dtype=torch.long)
            alone = model.generate(input_ids=torch.tensor([ids]), attention_mask=ones,
                                   max_new_tokens=4, min_new_tokens=2, do_sample=False, pad_token_id=EOS)
            got = out[i, input_ids.shape[1]:]
            want = alone[0, len(ids):]
            # after a row emits EOS, generate fills the rest with pad (= EOS) too
            n = min(len(got), len(want))
            assert torch.equal(got[:n], want[:n]), (i, got, want)
    print("responses:", out[:, input_ids.shape[1]:].tolist())


if __name__ == "__main__":
    main()
