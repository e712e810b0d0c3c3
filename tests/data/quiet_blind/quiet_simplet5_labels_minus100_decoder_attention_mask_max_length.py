# Correct program (quiet batch quiet-r85a).
# Ported from Shivanandroy/simpleT5 simplet5/simplet5.py @02ada13bdb322fd7749c6ffd0a9089f54f7e1427
# (PyTorchDataModule.__getitem__, LightningModel.forward / training_step / validation_step).
# simpleT5 fine-tunes T5 for summarization: the source and the target are each tokenized with
# padding="max_length" (T5's pad id 0, padded on the right), the target's pad ids are replaced by -100 in
# `labels`, and the target's tokenizer attention_mask goes to the model as `decoder_attention_mask`
# ("labels_attention_mask"); T5 shifts the labels right itself (decoder_start_token_id == pad == 0, -100 -> pad).
# Self-check: the batched loss and the logits at every real target position equal a per-example run on the
# unpadded source and target with no masks at all (token-weighted mean of the per-example summed losses).
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)

PAD, EOS = 0, 1


class ToyT5Tokenizer:
    """Stands in for T5TokenizerFast: ids are given, </s> appended, right padding to max_length."""

    pad_token_id = PAD

    def __call__(self, ids, max_length, padding="max_length", truncation=True, return_attention_mask=True,
                 add_special_tokens=True, return_tensors="pt"):
        ids = list(ids)[: max_length - 1] + [EOS]
        n = len(ids)
        input_ids = torch.tensor([ids + [PAD] * (max_length - n)])
        attention_mask = torch.tensor([[1] * n + [0] * (max_length - n)])
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class PyTorchDataModule(Dataset):
    """  PyTorch Dataset class  """

    def __init__(self, data, tokenizer, source_max_token_len=12, target_max_token_len=8):
        self.tokenizer = tokenizer
        self.data = data
        self.source_max_token_len = source_max_token_len
        self.target_max_token_len = target_max_token_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index: int):
        data_row = self.data[index]
        source_text = data_row["source_text"]

        source_text_encoding = self.tokenizer(
            source_text,
            max_length=self.source_max_token_len,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            add_special_tokens=True,
            return_tensors="pt",
        )

        target_text_encoding = self.tokenizer(
            data_row["target_text"],
            max_length=self.target_max_token_len,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            add_special_tokens=True,
            return_tensors="pt",
        )

        labels = target_text_encoding["input_ids"]
        labels[labels == 0] = -100  # to make sure we have correct labels for T5 text generation

        return dict(
            source_text_input_ids=source_text_encoding["input_ids"].flatten(),
            source_text_attention_mask=source_text_encoding["attention_mask"].flatten(),
            labels=labels.flatten(),
            labels_attention_mask=target_text_encoding["attention_mask"].flatten(),
        )


class LightningModel(torch.nn.Module):
    """ PyTorch Lightning Model class (trimmed to a torch module) """

    def __init__(self, tokenizer, model):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    def forward(self, input_ids, attention_mask, decoder_attention_mask, labels=None):
        output = self.model(
            input_ids,
            attention_mask=attention_mask,
            labels=labels,
            decoder_attention_mask=decoder_attention_mask,
        )
        return output.loss, output.logits

    def training_step(self, batch, batch_size):
        input_ids = batch["source_text_input_ids"]
        attention_mask = batch["source_text_attention_mask"]
        labels = batch["labels"]
        labels_attention_mask = batch["labels_attention_mask"]

        loss, outputs = self(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_attention_mask=labels_attention_mask,
            labels=labels,
        )
        return loss, outputs


config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                  pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, feed_forward_proj="relu")
t5 = T5ForConditionalGeneration(config).eval()
tokenizer = ToyT5Tokenizer()
module = LightningModel(tokenizer, t5)

data = [
    {"source_text": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "target_text": [20, 21, 22, 23, 24, 25]},
    {"source_text": [30, 31, 32], "target_text": [40, 41]},
    {"source_text": [50, 51, 52, 53, 54, 55], "target_text": [60, 61, 62, 63]},
]
loader = DataLoader(PyTorchDataModule(data, tokenizer), batch_size=3, shuffle=False)
batch = next(iter(loader))

with torch.no_grad():
    loss, logits = module.training_step(batch, 3)

# Reference: each example alone, unpadded source and target, no attention masks, shifted by hand.
total, count = 0.0, 0
with torch.no_grad():
    for i, row in enumerate(data):
        src = torch.tensor([row["source_text"] + [EOS]])
        tgt = torch.tensor([row["target_text"] + [EOS]])
        dec_in = torch.cat([torch.tensor([[PAD]]), tgt[:, :-1]], dim=1)
        ref_logits = t5(input_ids=src, decoder_input_ids=dec_in).logits
        n = tgt.shape[1]
        assert torch.allclose(logits[i, :n], ref_logits[0], atol=1e-5), i
        total += torch.nn.functional.cross_entropy(ref_logits[0], tgt[0], reduction="sum").item()
        count += n
assert abs(loss.item() - total / count) < 1e-5, (loss.item(), total / count)
print("simpleT5 batch loss", round(loss.item(), 5), "== per-example reference", round(total / count, 5))
