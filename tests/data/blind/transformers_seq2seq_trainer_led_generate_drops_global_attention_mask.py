"""huggingface/transformers#16485 ("Add global_attention_mask to gen_kwargs in Seq2SeqTrainer.prediction_step").

Seq2SeqTrainer.prediction_step (src/transformers/trainer_seq2seq.py, v4.17) evaluates with predict_with_generate by
building gen_kwargs from the batch: it copied `attention_mask` but not `global_attention_mask`, then called
model.generate(generation_inputs, **gen_kwargs). For LED (PRIMERA, led-base-16384) the encoder inside generate then
ran with local sliding-window attention only: the <s> token the collator marks global neither sees nor is seen by
the whole document, so the evaluated summaries differ from the ones the model was trained to write (the loss pass,
model(**inputs), did get the global mask). Fix: `if "global_attention_mask" in inputs:
gen_kwargs["global_attention_mask"] = inputs.get("global_attention_mask", None)`.

A tiny LEDForConditionalGeneration (built from LEDConfig, no download), a right-padded batch of two documents (pad
id 1), global attention on each document's first token, greedy generation as the trainer runs it."""

import sys

import torch
from transformers import LEDConfig, LEDForConditionalGeneration

FIXED = "--fixed" in sys.argv


def collate(features, pad_token_id):
    # DataCollatorForSeq2Seq-style padding (right side) of the tokenized documents and labels, plus the
    # global_attention_mask the LED summarization recipe adds: global attention on the first token (<s>).
    max_len = max(len(f["input_ids"]) for f in features)
    max_lab = max(len(f["labels"]) for f in features)
    input_ids, attention_mask, labels = [], [], []
    for f in features:
        n = len(f["input_ids"])
        input_ids.append(f["input_ids"] + [pad_token_id] * (max_len - n))
        attention_mask.append([1] * n + [0] * (max_len - n))
        labels.append(f["labels"] + [-100] * (max_lab - len(f["labels"])))
    batch = {
        "input_ids": torch.tensor(input_ids),
        "attention_mask": torch.tensor(attention_mask),
        "labels": torch.tensor(labels),
    }
    global_attention_mask = torch.zeros_like(batch["input_ids"])
    global_attention_mask[:, 0] = 1
    batch["global_attention_mask"] = global_attention_mask
    return batch


class Seq2SeqTrainer:
    """The evaluation half of transformers' Seq2SeqTrainer (prediction_step with predict_with_generate)."""

    def __init__(self, model, max_length=None, num_beams=None):
        self.model = model
        self._max_length = max_length
        self._num_beams = num_beams

    def _prepare_inputs(self, inputs):
        return {k: v.to(self.model.device) for k, v in inputs.items()}

    def _pad_tensors_to_max_len(self, tensor, max_length):
        pad_token_id = self.model.config.pad_token_id
        padded_tensor = pad_token_id * torch.ones((tensor.shape[0], max_length), dtype=tensor.dtype, device=tensor.device)
        padded_tensor[:, : tensor.shape[-1]] = tensor
        return padded_tensor

    def prediction_step(self, model, inputs, prediction_loss_only=False):
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)

        gen_kwargs = {
            "max_length": self._max_length if self._max_length is not None else self.model.config.max_length,
            "num_beams": self._num_beams if self._num_beams is not None else self.model.config.num_beams,
            "synced_gpus": False,
        }

        if "attention_mask" in inputs:
            gen_kwargs["attention_mask"] = inputs.get("attention_mask", None)
        if FIXED:
            if "global_attention_mask" in inputs:
                gen_kwargs["global_attention_mask"] = inputs.get("global_attention_mask", None)

        # prepare generation inputs
        # some encoder-decoder models can have varying encoder's and thus
        # varying model input names
        if hasattr(self.model, "encoder") and self.model.encoder.main_input_name != self.model.main_input_name:
            generation_inputs = inputs[self.model.encoder.main_input_name]
        else:
            generation_inputs = inputs[self.model.main_input_name]

        generated_tokens = self.model.generate(
            generation_inputs,
            **gen_kwargs,
        )
        # in case the batch is shorter than max length, the output should be padded
        if generated_tokens.shape[-1] < gen_kwargs["max_length"]:
            generated_tokens = self._pad_tensors_to_max_len(generated_tokens, gen_kwargs["max_length"])

        with torch.no_grad():
            if has_labels:
                outputs = model(**inputs)
                loss = outputs["loss"].mean().detach()
            else:
                loss = None

        if prediction_loss_only:
            return (loss, None, None)

        labels = inputs["labels"] if has_labels else None
        if has_labels and labels.shape[-1] < gen_kwargs["max_length"]:
            labels = self._pad_tensors_to_max_len(labels, gen_kwargs["max_length"])

        return (loss, generated_tokens, labels)


def main():
    torch.manual_seed(0)
    config = LEDConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        attention_window=[4, 4],
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        init_std=0.3,
        dropout=0.0,
        attention_dropout=0.0,
    )
    model = LEDForConditionalGeneration(config).eval()

    g = torch.Generator().manual_seed(1)
    features = []
    for doc_len, sum_len in ((22, 6), (15, 5)):
        body = torch.randint(4, config.vocab_size, (doc_len - 2,), generator=g).tolist()
        summary = torch.randint(4, config.vocab_size, (sum_len - 2,), generator=g).tolist()
        features.append({"input_ids": [0] + body + [2], "labels": [0] + summary + [2]})
    batch = collate(features, config.pad_token_id)

    trainer = Seq2SeqTrainer(model, max_length=12, num_beams=1)
    loss, generated_tokens, labels = trainer.prediction_step(model, batch)
    print("eval loss:", round(loss.item(), 4))
    for row in generated_tokens.tolist():
        print("generated:", row)


if __name__ == "__main__":
    main()
