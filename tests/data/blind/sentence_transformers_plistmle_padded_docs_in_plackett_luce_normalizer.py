# Citation: huggingface/sentence-transformers#3827 ("[fix] Exclude padding from the Plackett-Luce normalizer in
#   ListMLE/PListMLE losses"), merged as commit 7763e94154f60cde77e93d4b50d32bc3a364860e; the code before the fix
#   is sentence_transformers/cross_encoder/losses/plist_mle.py at 7763e941^.
# Upstream: PListMLELambdaWeight.forward and PListMLELoss.forward (ListMLELoss is PListMLELoss with
#   lambda_weight=None). The CrossEncoder is trimmed to what the loss calls: preprocess() tokenizes the
#   (query, document) pairs right-padded to the longest pair, forward() returns {"scores": ...} from a
#   BertForSequenceClassification head with one label. A tiny BertConfig model and a BertTokenizerFast over a
#   small vocab stand in for the checkpoint.
# Bug: each query's list of documents is padded to the batch's longest list with a logit of 1e-16 and a boolean
#   mask of the real entries. The Plackett-Luce normalizer (a reverse cumsum of exp(logits)) was built over the
#   whole padded row and the mask applied only afterwards to the log-probabilities, so every padded slot added
#   exp(1e-16) ~ 1 to the denominator of every real document: a short list's loss and gradients depended on how
#   long the other lists in its batch were.
# Fix: gather the mask into the sorted order and zero the padded scores before the cumsum
#   (`scores = sorted_logits.exp().masked_fill(~sorted_mask, 0.0)`), then mask log_probs with the sorted mask.
import os
import sys
import tempfile

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def batch_to_device(batch, target_device):
    for key in batch:
        if isinstance(batch[key], Tensor):
            batch[key] = batch[key].to(target_device)
    return batch


# ---------------------------------------------------------------- cross_encoder/model.py (trimmed)
class CrossEncoder(nn.Module):
    def __init__(self, model, tokenizer, max_length=64):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def num_labels(self):
        return self.model.config.num_labels

    def preprocess(self, inputs, prompt=None, task=None):
        texts = [[], []]
        for query, document in inputs:
            texts[0].append(query.strip())
            texts[1].append(document.strip())
        return self.tokenizer(
            *texts,
            padding=True,
            truncation="longest_first",
            return_tensors="pt",
            max_length=self.max_length,
        )

    def forward(self, features):
        out = self.model(
            input_ids=features["input_ids"],
            attention_mask=features["attention_mask"],
            token_type_ids=features.get("token_type_ids"),
        )
        features["scores"] = out.logits
        return features


# ---------------------------------------------------------------- cross_encoder/losses/plist_mle.py
class PListMLELambdaWeight(nn.Module):
    """Base class for implementing weighting schemes in Position-Aware ListMLE Loss."""

    def __init__(self, rank_discount_fn=None) -> None:
        super().__init__()
        self.rank_discount_fn = rank_discount_fn

    def forward(self, mask: Tensor) -> Tensor:
        if self.rank_discount_fn is not None:
            return self.rank_discount_fn(mask)

        # Apply default rank discount: 2^(num_docs - rank) - 1
        num_docs_per_query = mask.sum(dim=1, keepdim=True)
        ranks = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
        weights = torch.pow(2.0, num_docs_per_query - ranks) - 1.0
        weights = weights * mask
        return weights


class PListMLELoss(nn.Module):
    def __init__(
        self,
        model: CrossEncoder,
        lambda_weight: PListMLELambdaWeight | None = PListMLELambdaWeight(),
        activation_fn: nn.Module | None = nn.Identity(),
        mini_batch_size: int | None = None,
        respect_input_order: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.lambda_weight = lambda_weight
        self.activation_fn = activation_fn or nn.Identity()
        self.mini_batch_size = mini_batch_size
        self.respect_input_order = respect_input_order
        self.eps = 1e-10

        if self.model.num_labels != 1:
            raise ValueError(
                f"{self.__class__.__name__} supports a model with 1 output label, "
                f"but got a model with {self.model.num_labels} output labels."
            )

    def forward(self, inputs, labels, prompt=None, task=None) -> Tensor:
        if isinstance(labels, Tensor):
            raise ValueError(
                "PListMLELoss expects a list of labels for each sample, but got a single value for each sample."
            )

        if len(inputs) != 2:
            raise ValueError(
                f"PListMLELoss expects two inputs (queries, documents_list), but got {len(inputs)} inputs."
            )

        queries, docs_list = inputs
        docs_per_query = [len(docs) for docs in docs_list]
        max_docs = max(docs_per_query)
        batch_size = len(queries)

        if docs_per_query != [len(lbls) for lbls in labels]:
            raise ValueError(
                f"Number of documents per query in inputs ({docs_per_query}) does not match number of labels per query ({[len(lbls) for lbls in labels]})."
            )

        pairs = [(query, document) for query, docs in zip(queries, docs_list) for document in docs]

        mini_batch_size = self.mini_batch_size or batch_size
        if mini_batch_size <= 0:
            mini_batch_size = len(pairs)

        logits_list = []
        for i in range(0, len(pairs), mini_batch_size):
            mini_batch_pairs = pairs[i : i + mini_batch_size]

            tokens = self.model.preprocess(mini_batch_pairs, prompt=prompt, task=task)
            tokens = batch_to_device(tokens, self.model.device)

            logits = self.model(tokens)["scores"].view(-1)
            logits_list.append(logits)

        logits = torch.cat(logits_list, dim=0).float()
        logits = self.activation_fn(logits)

        # Create output tensor filled with a very small value for padded logits
        logits_matrix = torch.full((batch_size, max_docs), 1e-16, device=self.model.device)

        # Place logits in the desired positions in the logit matrix
        doc_indices = torch.cat([torch.arange(len(docs)) for docs in docs_list], dim=0)
        batch_indices = torch.repeat_interleave(torch.arange(batch_size), torch.tensor(docs_per_query))
        logits_matrix[batch_indices, doc_indices] = logits

        # Create a mask for valid entries
        mask = torch.zeros_like(logits_matrix, dtype=torch.bool)
        mask[batch_indices, doc_indices] = True

        # Convert labels to tensor matrix
        labels_matrix = torch.full_like(logits_matrix, -float("inf"))
        labels_matrix[batch_indices, doc_indices] = torch.cat(labels, dim=0).float()

        if not torch.any(mask):
            return torch.tensor(0.0, device=self.model.device, requires_grad=True)

        if not self.respect_input_order:
            # Sort by labels in descending order if not respecting input order.
            sorted_labels, indices = labels_matrix.sort(descending=True, dim=1)
            sorted_logits = torch.gather(logits_matrix, 1, indices)
            if FIXED:
                sorted_mask = torch.gather(mask, 1, indices)
        else:
            # Use the original input order, assuming it's already ordered by relevance
            sorted_logits = logits_matrix
            if FIXED:
                sorted_mask = mask

        # Compute log-likelihood using Plackett-Luce model
        if FIXED:
            scores = sorted_logits.exp().masked_fill(~sorted_mask, 0.0)
        else:
            scores = sorted_logits.exp()
        cumsum_scores = torch.flip(torch.cumsum(torch.flip(scores, [1]), 1), [1])
        log_probs = sorted_logits - torch.log(cumsum_scores + self.eps)

        # Apply position-aware lambda weights if specified. If None, then this loss
        # is just ListMLE.
        if self.lambda_weight is not None:
            lambda_weight = self.lambda_weight(mask)
            # Normalize weights to sum to 1
            lambda_weight = lambda_weight / (lambda_weight.sum(dim=1, keepdim=True) + self.eps)
            log_probs = log_probs * lambda_weight

        # Sum the log probabilities for each list and mask padded entries
        if FIXED:
            log_probs[~sorted_mask] = 0.0
        else:
            log_probs[~mask] = 0.0
        per_query_losses = -torch.sum(log_probs, dim=1)

        if not torch.any(per_query_losses):
            return torch.tensor(0.0, device=self.model.device, requires_grad=True)

        # Average loss over all lists
        return torch.mean(per_query_losses)


class ListMLELoss(PListMLELoss):
    def __init__(self, model, activation_fn=nn.Identity(), mini_batch_size=None, respect_input_order=True):
        super().__init__(
            model,
            lambda_weight=None,
            activation_fn=activation_fn,
            mini_batch_size=mini_batch_size,
            respect_input_order=respect_input_order,
        )


# ---------------------------------------------------------------- a reranker training step
def build_model(tmpdir):
    words = (
        "what are pandas a kind of bear like fish is the capital france paris quite large "
        "how tall mount everest highest mountain in world meters nepal tibet snow climbers "
        "it rains often london city river thames"
    ).split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words)) + ["?", "."]
    path = os.path.join(tmpdir, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=path, do_lower_case=True)
    tokenizer.model_max_length = 64

    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.3,
        num_labels=1,
    )
    model = BertForSequenceClassification(config).eval()
    return CrossEncoder(model, tokenizer)


def main():
    with tempfile.TemporaryDirectory() as tmpdir:
        model = build_model(tmpdir)

    queries = ["What are pandas?", "What is the capital of France?", "How tall is Mount Everest?"]
    docs = [
        ["Pandas are a kind of bear.", "Pandas are kind of like fish."],
        ["The capital of France is Paris.", "Paris is quite large.", "It rains often in London."],
        [
            "Mount Everest is the highest mountain in the world.",
            "Everest is 8848 meters tall.",
            "It is in Nepal and Tibet.",
            "Climbers like snow.",
            "London is a city.",
            "The Thames is a river.",
        ],
    ]
    labels = [
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, 0.5, 0.0]),
        torch.tensor([1.0, 0.8, 0.5, 0.3, 0.0, 0.0]),
    ]

    for name, loss_fn in [
        ("PListMLELoss", PListMLELoss(model)),
        ("ListMLELoss (unsorted input)", ListMLELoss(model, respect_input_order=False)),
    ]:
        model.zero_grad()
        loss = loss_fn((queries, docs), labels)
        loss.backward()
        grad = model.model.classifier.weight.grad
        print(f"{name}: loss {loss.item():.6f}  classifier grad norm {grad.norm().item():.6f}")

    # one optimizer step with the position-aware loss, then the reranked order of the second query's documents
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmpdir:
        model = build_model(tmpdir)
    model.train()
    loss_fn = PListMLELoss(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        optimizer.zero_grad()
        loss = loss_fn((queries, docs), labels)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        pairs = [(queries[1], d) for d in docs[1]]
        scores = model(model.preprocess(pairs))["scores"].view(-1)
    print("scores for query 1:", [round(s, 5) for s in scores.tolist()])


if __name__ == "__main__":
    main()
