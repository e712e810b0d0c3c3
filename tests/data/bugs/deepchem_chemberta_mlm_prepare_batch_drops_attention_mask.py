# DeepChem ChemBERTa (HuggingFaceModel, task='mlm'), deepchem/deepchem#3597 (fixed by deepchem/deepchem#3667).
# _prepare_batch pads the SMILES batch but the MLM branch builds the model inputs from input_ids and
# labels only, dropping the tokenizer's attention_mask, so RoBERTa attends to <pad> tokens.
import sys

import torch
from transformers import RobertaConfig, RobertaForMaskedLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SmilesCharTokenizer:
    """Stand-in for the RobertaTokenizerFast ChemBERTa uses: <s> SMILES </s>, right padding."""

    def __init__(self):
        chars = list("CNOSPFIBrcl()=#[]123456789@+-Hn")
        self.special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
        self.vocab = dict(self.special)
        for ch in chars:
            self.vocab.setdefault(ch, len(self.vocab))
        self.pad_token_id = 1
        self.mask_token_id = 4

    def __len__(self):
        return len(self.vocab)

    def __call__(self, smiles, padding=True, return_tensors="pt"):
        ids = [[0] + [self.vocab.get(c, 3) for c in s] + [2] for s in smiles]
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), L), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x)
            attention_mask[i, :len(x)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class DataCollatorForLanguageModeling:
    """transformers' torch_mask_tokens, trimmed (special tokens and padding are never masked)."""

    def __init__(self, tokenizer, mlm_probability=0.15):
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability

    def torch_mask_tokens(self, inputs):
        labels = inputs.clone()
        probability_matrix = torch.full(labels.shape, self.mlm_probability)
        special_tokens_mask = inputs <= 2
        probability_matrix.masked_fill_(special_tokens_mask, value=0.0)
        masked_indices = torch.bernoulli(probability_matrix).bool()
        labels[~masked_indices] = -100
        indices_replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked_indices
        inputs = inputs.clone()
        inputs[indices_replaced] = self.tokenizer.mask_token_id
        return inputs, labels


class HuggingFaceModel:
    def __init__(self, model, tokenizer, task="mlm"):
        self.model = model
        self.tokenizer = tokenizer
        self.task = task
        self.device = torch.device("cpu")
        self.data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)

    def _prepare_batch(self, batch):
        smiles_batch, y, w = batch
        tokens = self.tokenizer(smiles_batch[0], padding=True, return_tensors="pt")
        if self.task == "mlm":
            inputs, labels = self.data_collator.torch_mask_tokens(tokens["input_ids"])
            if FIXED:
                inputs = {
                    "input_ids": inputs.to(self.device),
                    "labels": labels.to(self.device),
                    "attention_mask": tokens["attention_mask"].to(self.device),
                }
            else:
                inputs = {"input_ids": inputs.to(self.device), "labels": labels.to(self.device)}
            return inputs, None, w


tokenizer = SmilesCharTokenizer()
config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       initializer_range=0.2)
model = RobertaForMaskedLM(config)
dc_model = HuggingFaceModel(model=model, tokenizer=tokenizer, task="mlm")

smiles = ["CC(=O)Oc1ccccc1C(=O)O", "CCO", "c1ccncc1"]
inputs, _, _ = dc_model._prepare_batch(([smiles], None, None))

model.train()  # fit_generator: model.train(); outputs = self.model(**inputs)
outputs = model(**inputs)
logits = outputs.logits.detach()

# reference: each molecule alone, unpadded, same masked tokens
lengths = [len(s) + 2 for s in smiles]
max_diff = 0.0
for i, n in enumerate(lengths):
    alone = model(input_ids=inputs["input_ids"][i:i + 1, :n]).logits.detach()
    max_diff = max(max_diff, (logits[i, :n] - alone[0]).abs().max().item())
print(f"mlm loss (batched): {outputs.loss.item():.6f}")
print(f"max |batched - per-molecule| logits on real tokens: {max_diff:.6f}")
