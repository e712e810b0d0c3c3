"""transformers-bart-pretrain: BART pre-training batches padded sources but fed no attention_mask.

Citation: cosmoquester/transformers-bart-pretrain PR #11 ("fix: Add attention mask", merged 2021-07-28),
commit 1ece16b ("fix: Use Attention mask"), scripts/train.py and transformers_bart_pretrain/data.py.
Read from the repository history.

Bug: `make_train_examples` returned only `{"input_ids", "decoder_input_ids"}` and `train.py` batched them
with `padded_batch(batch_size, pad_shape, pad_values)` padding `input_ids` with
`model_config.pad_token_id`; the model (`TFBartForConditionalGeneration(model_config)`) was then called
with no `attention_mask`, so the encoder self-attention and the decoder's cross-attention attended to the
source padding of every shorter example in a batch.
Fix: `make_train_examples` adds `"attention_mask": tf.ones_like(source_tokens)`, `text_infilling` carries
it through, and `padded_batch` pads it with 0.

This program is a torch rendering of that pipeline (the repository is TensorFlow): the same
`make_train_examples` / `padded_batch` steps on lists of token ids (text infilling left out), feeding
transformers' `BartForConditionalGeneration(BartConfig(...))` with random weights (eager attention).
Two examples of source lengths 9 and 5. `--fixed` adds and pads the attention_mask as the fix does.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv


def make_train_examples(source_tokens, target_tokens):
    """Make training examples from source and target tokens."""
    example = {"input_ids": source_tokens, "decoder_input_ids": target_tokens[:-1]}
    if FIXED:
        example["attention_mask"] = torch.ones_like(source_tokens, dtype=torch.int32)
    return example, target_tokens[1:]


def padded_batch(examples, pad_values):
    """tf.data.Dataset.padded_batch with per-key pad values (shapes padded to the batch maximum)."""
    inputs = {}
    for key, value in pad_values[0].items():
        seqs = [ex[0][key] for ex in examples]
        inputs[key] = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)
    labels = torch.nn.utils.rnn.pad_sequence([ex[1] for ex in examples], batch_first=True,
                                             padding_value=pad_values[1])
    return inputs, labels


def main():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    model_config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=2, decoder_attention_heads=2,
                              encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="eager")
    model = BartForConditionalGeneration(model_config).eval()

    corpus = [
        (torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 2]), torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 2])),
        (torch.tensor([0, 12, 13, 14, 2]), torch.tensor([0, 12, 13, 14, 2])),
    ]
    examples = [make_train_examples(s, t) for s, t in corpus]
    pad_values = ({"input_ids": model_config.pad_token_id,
                   "decoder_input_ids": model_config.pad_token_id}, model_config.pad_token_id)
    if FIXED:
        pad_values[0]["attention_mask"] = 0
    inputs, labels = padded_batch(examples, pad_values)
    with torch.no_grad():
        out = model(**inputs)
    print("fixed" if FIXED else "buggy", sorted(inputs), tuple(out.logits.shape),
          round(float(out.logits[1].abs().sum()), 3))


if __name__ == "__main__":
    main()
