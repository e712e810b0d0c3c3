"""Sentence-pair classification (MNLI-style, 3 labels) over a dynamically padded batch, the way
huggingface/transformers examples/pytorch/text-classification/run_glue_no_trainer.py does it
(preprocess_function: tokenizer(*texts, padding=False, max_length=..., truncation=True) giving
token_type_ids 0 for the premise and 1 for the hypothesis; DataCollatorWithPadding(pad_to_multiple_of=8);
evaluation loop with outputs.logits.argmax(-1)), with a tiny AlbertForSequenceClassification built from a
config (default SDPA attention; the 2-D padding mask is expanded by the model to a 4-D key mask, pooler on the
[CLS] position 0, which is never padding because padding is on the right).

Reference: every pair run alone, unpadded, with no attention mask; logits, loss and predictions compared.
"""
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import AlbertConfig, AlbertForSequenceClassification, DataCollatorWithPadding, PreTrainedTokenizerFast

torch.manual_seed(0)

WORDS = ("a man is playing guitar on stage the woman sleeps person music outside dog runs in park "
         "cat nobody plays an instrument animal moving there are two people kids eat lunch").split()
vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"] + WORDS)}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.normalizer = normalizers.Lowercase()
backend.pre_tokenizer = pre_tokenizers.Whitespace()
backend.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", cls_token="[CLS]", sep_token="[SEP]",
    mask_token="[MASK]", padding_side="right", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
)

raw = {
    "premise": [
        "a man is playing guitar on stage",
        "the dog runs",
        "two people eat lunch in the park",
        "a woman sleeps",
        "kids are playing music outside in the park",
    ],
    "hypothesis": [
        "a person plays an instrument",
        "an animal is moving",
        "nobody is there",
        "the woman is playing guitar on stage",
        "kids",
    ],
    "label": [0, 0, 2, 2, 1],
}
sentence1_key, sentence2_key = "premise", "hypothesis"
max_seq_length = 24


def preprocess_function(examples):
    texts = (examples[sentence1_key],) if sentence2_key is None else (examples[sentence1_key], examples[sentence2_key])
    result = tokenizer(*texts, padding=False, max_length=max_seq_length, truncation=True)
    result["labels"] = examples["label"]
    return result


config = AlbertConfig(
    vocab_size=len(vocab), embedding_size=16, hidden_size=32, num_hidden_layers=3, num_hidden_groups=1,
    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, num_labels=3, pad_token_id=0,
)
model = AlbertForSequenceClassification(config).double().eval()

processed = preprocess_function(raw)
n = len(raw["label"])
features = [{k: processed[k][i] for k in ["input_ids", "token_type_ids", "attention_mask", "labels"]} for i in range(n)]
data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

# evaluation loop, batch size 3 (two batches of different padded widths)
all_logits, all_preds, losses = [], [], []
with torch.no_grad():
    for b in range(0, n, 3):
        batch = data_collator(features[b : b + 3])
        print("batch", b // 3, "shape", tuple(batch["input_ids"].shape), "pad per row",
              (batch["attention_mask"] == 0).sum(-1).tolist(),
              "type-1 per row", batch["token_type_ids"].sum(-1).tolist())
        outputs = model(**batch)
        all_logits.append(outputs.logits)
        all_preds.append(outputs.logits.argmax(dim=-1))
        losses.append(F.cross_entropy(outputs.logits, batch["labels"], reduction="sum"))
logits_batched = torch.cat(all_logits)
preds_batched = torch.cat(all_preds)
loss_batched = torch.stack(losses).sum() / n

# reference: each pair alone, no padding, no mask
with torch.no_grad():
    ref_logits = torch.cat([
        model(input_ids=torch.tensor([f["input_ids"]]), token_type_ids=torch.tensor([f["token_type_ids"]])).logits
        for f in features
    ])
ref_loss = F.cross_entropy(ref_logits, torch.tensor(raw["label"]))
max_diff = (ref_logits - logits_batched).abs().max().item()
print("max |logit diff| padded batches vs each pair alone:", max_diff)
print("loss batched", loss_batched.item(), "reference", ref_loss.item())
print("predictions", preds_batched.tolist(), ref_logits.argmax(-1).tolist())
ok = max_diff < 1e-10 and abs(loss_batched.item() - ref_loss.item()) < 1e-10 and preds_batched.tolist() == ref_logits.argmax(-1).tolist()
print("MATCH" if ok else "MISMATCH")
assert ok
