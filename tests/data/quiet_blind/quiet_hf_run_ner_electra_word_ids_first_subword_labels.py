"""Token classification over words split into sub-words, the way huggingface/transformers
examples/pytorch/token-classification/run_ner.py does it (tokenize_and_align_labels with word_ids, label only
the first sub-word of each word, -100 for special tokens and continuation pieces, DataCollatorForTokenClassification
padding input_ids with the pad id, attention_mask with 0 and labels with -100, pad_to_multiple_of=8) and
compute_metrics (drop positions whose label is -100), with a tiny ElectraForTokenClassification built from a
config (eager attention: the extended additive mask (1 - mask) * finfo.min added to the scores).

Reference: each sentence run alone, unpadded, with no attention mask; loss recomputed as the sum of per-token
cross-entropies over first sub-words divided by their count; word-level predictions compared.
"""
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    DataCollatorForTokenClassification,
    ElectraConfig,
    ElectraForTokenClassification,
    PreTrainedTokenizerFast,
)

torch.manual_seed(0)

WORDS = "john live in paris and mary work at new york city visit berlin the".split()
PIECES = ["##s", "##ed", "##ing", "##er", "##le", "##um"]
vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + PIECES + ["goog", "muse"])}
backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
backend.normalizer = normalizers.Lowercase()
backend.pre_tokenizer = pre_tokenizers.Whitespace()
backend.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
    mask_token="[MASK]", padding_side="right", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
)

label_list = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG"]
label_to_id = {l: i for i, l in enumerate(label_list)}
b_to_i_label = [label_list.index(l.replace("B-", "I-")) if l.replace("B-", "I-") in label_list else i
                for i, l in enumerate(label_list)]
raw = {
    "tokens": [
        ["John", "lives", "in", "Paris"],
        ["Mary", "worked", "at", "Google", "in", "New", "York", "City", "and", "visited", "Berlin"],
        ["visiting", "the", "museum"],
    ],
    "ner_tags": [
        ["B-PER", "O", "O", "B-LOC"],
        ["B-PER", "O", "O", "B-ORG", "O", "B-LOC", "I-LOC", "I-LOC", "O", "O", "B-LOC"],
        ["O", "O", "O"],
    ],
}
label_all_tokens = False


def tokenize_and_align_labels(examples):
    tokenized_inputs = tokenizer(examples["tokens"], padding=False, truncation=True, max_length=32,
                                 is_split_into_words=True)
    labels = []
    for i, label in enumerate(examples["ner_tags"]):
        word_ids = tokenized_inputs.word_ids(batch_index=i)
        previous_word_idx = None
        label_ids = []
        for word_idx in word_ids:
            if word_idx is None:
                label_ids.append(-100)
            elif word_idx != previous_word_idx:
                label_ids.append(label_to_id[label[word_idx]])
            else:
                if label_all_tokens:
                    label_ids.append(b_to_i_label[label_to_id[label[word_idx]]])
                else:
                    label_ids.append(-100)
            previous_word_idx = word_idx
        labels.append(label_ids)
    tokenized_inputs["labels"] = labels
    return tokenized_inputs


config = ElectraConfig(
    vocab_size=len(vocab), embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    num_labels=len(label_list), pad_token_id=0,
)
config._attn_implementation = "eager"
model = ElectraForTokenClassification(config).double().eval()

tok = tokenize_and_align_labels(raw)
features = [{k: tok[k][i] for k in ["input_ids", "token_type_ids", "attention_mask", "labels"]}
            for i in range(len(raw["tokens"]))]
for i in range(len(features)):
    print("sentence", i, "word_ids", tok.word_ids(i))
collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
batch = collator(features)
print("batch shape", tuple(batch["input_ids"].shape), "pad per row", (batch["attention_mask"] == 0).sum(-1).tolist())
assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()

with torch.no_grad():
    out = model(**batch)
predictions = out.logits.argmax(-1).tolist()
labels = batch["labels"].tolist()
true_predictions = [[label_list[p] for (p, l) in zip(prediction, label) if l != -100]
                    for prediction, label in zip(predictions, labels)]

# reference: every sentence alone, no padding, no mask
loss_sum, count, max_diff, ref_predictions = 0.0, 0, 0.0, []
with torch.no_grad():
    for i, f in enumerate(features):
        ids = torch.tensor([f["input_ids"]])
        tt = torch.tensor([f["token_type_ids"]])
        lab = torch.tensor(f["labels"])
        logits = model(input_ids=ids, token_type_ids=tt).logits[0]
        L = ids.shape[1]
        max_diff = max(max_diff, (logits - out.logits[i, :L]).abs().max().item())
        keep = lab != -100
        loss_sum += F.cross_entropy(logits[keep], lab[keep], reduction="sum").item()
        count += int(keep.sum())
        ref_predictions.append([label_list[p] for p in logits[keep].argmax(-1).tolist()])
ref_loss = loss_sum / count
assert all(len(p) == len(w) for p, w in zip(true_predictions, raw["tokens"]))
print("max |logit diff| padded batch vs each sentence alone:", max_diff)
print("loss batched", out.loss.item(), "loss reference", ref_loss)
print("word predictions batched", true_predictions)
ok = max_diff < 1e-10 and abs(out.loss.item() - ref_loss) < 1e-10 and true_predictions == ref_predictions
print("MATCH" if ok else "MISMATCH")
assert ok
