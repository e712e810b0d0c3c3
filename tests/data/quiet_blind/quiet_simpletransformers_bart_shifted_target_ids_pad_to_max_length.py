# Correct program (quiet batch quiet-r85a).
# Ported from ThilinaRajapakse/simpletransformers simpletransformers/seq2seq/seq2seq_model.py
# @017ee2c1a064962f24524c666fe96c8219957b78 (Seq2SeqModel._get_inputs_dict, the "bart"/"marian" branch) and
# simpletransformers/seq2seq/seq2seq_utils.py @6b1aa47d20e7e462a6559573f9df5eaa87b142d1 (preprocess_data_bart,
# SimpleSummarizationDataset).
# simpletransformers fine-tunes BART for summarization: source and target are each encoded with
# pad_to_max_length=True (BART's pad id 1, right padding, "<s> ... </s>"); the decoder input is the target with
# its last column dropped (y[:, :-1]), the labels are the target shifted left (y[:, 1:]) with pad ids set to -100,
# and only the source's attention_mask goes to the model (the decoder keeps BART's own causal mask; its padding
# sits after every real token). The library's old `lm_labels` keyword is today's `labels`.
# Self-check: the batched loss, and the logits at every real target position, equal a per-example run on the
# unpadded source and target with no attention masks (token-weighted mean of per-example summed losses).
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BartConfig, BartForConditionalGeneration

torch.manual_seed(0)

BOS, PAD, EOS = 0, 1, 2


class ToyBartTokenizer:
    """Stands in for BartTokenizer.batch_encode_plus: ids given, <s> ... </s> added, right padding."""

    pad_token_id = PAD

    def batch_encode_plus(self, texts, max_length, pad_to_max_length=True, return_tensors="pt", truncation=True):
        ids = [BOS] + list(texts[0])[: max_length - 2] + [EOS]
        n = len(ids)
        return {
            "input_ids": torch.tensor([ids + [PAD] * (max_length - n)]),
            "attention_mask": torch.tensor([[1] * n + [0] * (max_length - n)]),
        }


def preprocess_data_bart(data):
    input_text, target_text, tokenizer, args = data

    input_ids = tokenizer.batch_encode_plus(
        [input_text], max_length=args.max_seq_length, pad_to_max_length=True, return_tensors="pt", truncation=True
    )

    target_ids = tokenizer.batch_encode_plus(
        [target_text], max_length=args.max_seq_length, pad_to_max_length=True, return_tensors="pt", truncation=True
    )

    return {
        "source_ids": input_ids["input_ids"].squeeze(),
        "source_mask": input_ids["attention_mask"].squeeze(),
        "target_ids": target_ids["input_ids"].squeeze(),
    }


class SimpleSummarizationDataset(Dataset):
    def __init__(self, tokenizer, args, data, mode):
        self.tokenizer = tokenizer
        data = [
            (input_text, target_text, tokenizer, args)
            for input_text, target_text in zip(data["input_text"], data["target_text"])
        ]
        self.examples = [preprocess_data_bart(d) for d in data]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


class Seq2SeqModel:
    def __init__(self, model, tokenizer, args):
        self.model = model
        self.encoder_tokenizer = tokenizer
        self.decoder_tokenizer = tokenizer
        self.args = args
        self.device = "cpu"

    def _get_inputs_dict(self, batch):
        device = self.device
        pad_token_id = self.encoder_tokenizer.pad_token_id
        source_ids, source_mask, y = batch["source_ids"], batch["source_mask"], batch["target_ids"]
        y_ids = y[:, :-1].contiguous()
        lm_labels = y[:, 1:].clone()
        lm_labels[y[:, 1:] == pad_token_id] = -100

        inputs = {
            "input_ids": source_ids.to(device),
            "attention_mask": source_mask.to(device),
            "decoder_input_ids": y_ids.to(device),
            "labels": lm_labels.to(device),
        }
        return inputs

    def eval_step(self, batch):
        inputs = self._get_inputs_dict(batch)
        outputs = self.model(**inputs)
        return outputs[0], outputs[1]


config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                    bos_token_id=BOS, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=EOS,
                    forced_eos_token_id=EOS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    init_std=0.2)
bart = BartForConditionalGeneration(config).eval()
args = SimpleNamespace(max_seq_length=12, model_type="bart")
tokenizer = ToyBartTokenizer()
st_model = Seq2SeqModel(bart, tokenizer, args)

data = {
    "input_text": [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]],
    "target_text": [[40, 41, 42], [43, 44, 45, 46, 47, 48, 49], [50]],
}
dataset = SimpleSummarizationDataset(tokenizer, args, data, "dev")
batch = next(iter(DataLoader(dataset, batch_size=3, shuffle=False)))

with torch.no_grad():
    loss, logits = st_model.eval_step(batch)

# Reference: each pair alone, unpadded, no masks: decoder sees <s> t1 .. tn, predicts t1 .. tn </s>.
total, count = 0.0, 0
with torch.no_grad():
    for i, (src, tgt) in enumerate(zip(data["input_text"], data["target_text"])):
        s = torch.tensor([[BOS] + src + [EOS]])
        y = torch.tensor([[BOS] + tgt + [EOS]])
        ref = bart(input_ids=s, decoder_input_ids=y[:, :-1]).logits[0]
        n = y.shape[1] - 1
        assert torch.allclose(logits[i, :n], ref, atol=1e-5), i
        total += torch.nn.functional.cross_entropy(ref, y[0, 1:], reduction="sum").item()
        count += n
assert abs(loss.item() - total / count) < 1e-5, (loss.item(), total / count)
print("simpletransformers BART eval loss", round(loss.item(), 5), "== per-example reference", round(total / count, 5))
