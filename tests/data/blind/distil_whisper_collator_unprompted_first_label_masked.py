# Citation: huggingface/distil-whisper#79 ("correctly mask bos in prompted ids", merge bb6177e),
# fixing the prompt mask added in huggingface/distil-whisper#77 (merge 006ce61).
# training/run_distillation.py, DataCollatorSpeechSeq2SeqWithPadding.__call__.
# Bug: the collator hides the prompt (<|startofprev|> ... <|startoftranscript|>) from the loss by masking every
# label up to one past the position argmax finds <|startoftranscript|>. In an un-prompted row the labels (ids
# shifted by one) hold no <|startoftranscript|>, argmax returns 0, and bos_index = 1 masks the first real target
# token of every un-prompted row to -100.
# Fix: add 1 only where the start token was found (bos_index > 0), so un-prompted rows keep all their labels.
import sys

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

FIXED = "--fixed" in sys.argv

PAD, EOT, SOT, PREV, LANG, TASK, NOTS = 0, 1, 2, 3, 4, 5, 6


class DataCollatorSpeechSeq2SeqWithPadding:
    def __init__(self, decoder_start_token_id, decoder_prev_token_id, max_target_length):
        self.decoder_start_token_id = decoder_start_token_id
        self.decoder_prev_token_id = decoder_prev_token_id
        self.max_target_length = max_target_length

    def _pad_labels(self, label_features):
        # tokenizer.pad(padding="max_length"): right padding, attention_mask 1 on real tokens
        ids = torch.full((len(label_features), self.max_target_length), PAD, dtype=torch.long)
        mask = torch.zeros((len(label_features), self.max_target_length), dtype=torch.long)
        for i, f in enumerate(label_features):
            ids[i, : len(f)] = torch.tensor(f)
            mask[i, : len(f)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def __call__(self, features):
        batch = {"input_features": torch.stack([f["input_features"] for f in features])}
        labels_batch = self._pad_labels([f["labels"] for f in features])

        # shift labels to the right to get decoder input ids
        labels = labels_batch["input_ids"]
        decoder_input_ids = labels[:, :-1]
        labels = labels[:, 1:]
        labels_mask = labels_batch["attention_mask"][:, 1:]

        # replace padding with -100 to ignore correctly when computing the loss
        labels = labels.masked_fill(labels_mask.ne(1), -100)

        # replace initial prompt tokens with -100 to ignore correctly when computing the loss
        bos_index = torch.argmax((labels == self.decoder_start_token_id).long(), dim=1)
        if FIXED:
            bos_index = torch.where(bos_index > 0, bos_index + 1, bos_index)
        else:
            bos_index = bos_index + 1
        prompt_mask = torch.arange(labels.shape[1]) < bos_index[:, None]
        labels = torch.where(prompt_mask, -100, labels)

        batch["labels"] = labels
        batch["decoder_input_ids"] = decoder_input_ids
        return batch


def main():
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=PAD, eos_token_id=EOT,
        bos_token_id=EOT, decoder_start_token_id=SOT,
    )
    model = WhisperForConditionalGeneration(config).eval()

    # un-prompted row, prompted row (condition_on_prev), un-prompted short row
    features = [
        {"input_features": torch.randn(8, 32), "labels": [SOT, LANG, TASK, NOTS, 20, 21, 22, EOT]},
        {"input_features": torch.randn(8, 32),
         "labels": [PREV, 30, 31, 32, SOT, LANG, TASK, NOTS, 23, 24, EOT]},
        {"input_features": torch.randn(8, 32), "labels": [SOT, LANG, TASK, NOTS, 25, EOT]},
    ]
    collator = DataCollatorSpeechSeq2SeqWithPadding(SOT, PREV, max_target_length=12)
    batch = collator(features)

    with torch.no_grad():
        out = model(**batch)
    n_targets = (batch["labels"] != -100).sum().item()
    print("labels:", batch["labels"].tolist())
    print("loss tokens:", n_targets, "loss: %.6f" % out.loss.item())


if __name__ == "__main__":
    main()
