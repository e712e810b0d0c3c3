# MinishLab/model2vec#358 ("fix(train): pad training batches with the model's pad id", merged).
# model2vec/train/dataset.py TextDataset.collate_fn padded every training batch with a hard-coded
# padding_value=0, while BaseFinetuneable._encode builds its pooling mask as `input_ids != self.pad_id`.
# For a model distilled from an XLM-R / RoBERTa tokenizer the pad id is 1 (id 0 is `<s>`, a real row of
# the vocabulary), so the padded slots are never masked: they get an embedding, a sigmoid(w) weight and
# count in the mean's length. The fix: TextDataset takes the pad id and pads with it
# (`padding_value=self.pad_id`), and `_prepare_dataset` hands it the model's pad id.
# Ported from model2vec/train/dataset.py, base.py, classifier.py, lightning_modules.py (bug state @c9014070);
# the Lightning trainer is replaced by the same training_step run by hand, the tokenizer by pre-tokenized ids.
import sys

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def logit(x: torch.Tensor) -> torch.Tensor:
    """Logit function."""
    return torch.log(x / (1 - x))


class TextDataset(Dataset):
    def __init__(self, tokenized_texts: list[list[int]], targets: torch.Tensor, pad_id: int = 0) -> None:
        """A dataset of texts."""
        if len(targets) != len(tokenized_texts):
            raise ValueError("Number of targets does not match number of texts.")
        self.tokenized_texts = tokenized_texts
        self.targets = targets
        self.pad_id = pad_id

    def __len__(self) -> int:
        """Return the length of the dataset."""
        return len(self.tokenized_texts)

    def __getitem__(self, index: int) -> tuple[list[int], torch.Tensor]:
        """Gets an item."""
        return self.tokenized_texts[index], self.targets[index]

    if FIXED:

        def collate_fn(self, batch: list[tuple[list[list[int]], int]]) -> tuple[torch.Tensor, torch.Tensor]:
            """Collate function."""
            texts, targets = zip(*batch)

            tensors: list[torch.Tensor] = [torch.LongTensor(x) for x in texts]
            padded = pad_sequence(tensors, batch_first=True, padding_value=self.pad_id)

            return padded, torch.stack(targets)

    else:

        @staticmethod
        def collate_fn(batch: list[tuple[list[list[int]], int]]) -> tuple[torch.Tensor, torch.Tensor]:
            """Collate function."""
            texts, targets = zip(*batch)

            tensors: list[torch.Tensor] = [torch.LongTensor(x) for x in texts]
            padded = pad_sequence(tensors, batch_first=True, padding_value=0)

            return padded, torch.stack(targets)

    def to_dataloader(self, shuffle: bool, batch_size: int = 32) -> DataLoader:
        """Convert the dataset to a DataLoader."""
        return DataLoader(self, collate_fn=self.collate_fn, shuffle=shuffle, batch_size=batch_size)


class StaticModelForClassification(nn.Module):
    """BaseFinetuneable + StaticModelForClassification, trimmed to what encodes and trains."""

    def __init__(
        self,
        *,
        vectors: torch.Tensor,
        n_layers: int = 1,
        hidden_dim: int = 512,
        out_dim: int = 2,
        pad_id: int = 0,
        token_mapping: list[int] | None = None,
        weights: torch.Tensor | None = None,
        freeze: bool = False,
        normalize: bool = True,
        freeze_weights: bool = False,
    ) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.out_dim = out_dim
        self.embed_dim = vectors.shape[1]
        self.hidden_dim = hidden_dim
        self.n_layers = n_layers
        self.normalize = normalize
        self.freeze_weights = freeze_weights

        self.vectors = vectors.float()
        if token_mapping is not None:
            self.token_mapping = torch.tensor(token_mapping, dtype=torch.int64)
        else:
            self.token_mapping = torch.arange(len(vectors), dtype=torch.int64)
        self.token_mapping = nn.Parameter(self.token_mapping, requires_grad=False)
        self.freeze = freeze
        self.embeddings = nn.Embedding.from_pretrained(vectors.clone(), freeze=self.freeze, padding_idx=pad_id)
        self.head = self.construct_head()
        self._weights = weights
        self.w = self.construct_weights()

    def construct_weights(self) -> nn.Parameter:
        """Construct the weights for the model."""
        if self._weights is not None:
            w = logit(self._weights)
        else:
            w = torch.zeros(len(self.token_mapping)).float()
            w[self.pad_id] = -10_000
        return nn.Parameter(w, requires_grad=not self.freeze_weights)

    def construct_head(self) -> nn.Sequential:
        """Constructs a simple classifier head."""
        modules: list[nn.Module] = []
        if self.n_layers == 0:
            modules.append(nn.Linear(self.embed_dim, self.out_dim))
        else:
            modules = [nn.Linear(self.embed_dim, self.hidden_dim), nn.ReLU()]
            for _ in range(self.n_layers - 1):
                modules.extend([nn.Linear(self.hidden_dim, self.hidden_dim), nn.ReLU()])
            modules.append(nn.Linear(self.hidden_dim, self.out_dim))

        linear_modules = [module for module in modules if isinstance(module, nn.Linear)]
        if linear_modules:
            *initial, last = linear_modules
            for module in initial:
                nn.init.kaiming_uniform_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(last.weight)
            nn.init.zeros_(last.bias)

        return nn.Sequential(*modules)

    def _encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A forward pass and mean pooling."""
        zeros = (input_ids != self.pad_id).float()
        # Add a small epsilon to avoid division by zero
        length = zeros.sum(1) + 1e-16
        input_ids_embeddings = self.token_mapping[input_ids]
        embedded = self.embeddings(input_ids_embeddings)

        w = self.w[input_ids]
        w = torch.sigmoid(w)
        w = w * zeros
        # Weigh each token
        embedded = torch.bmm(w[:, None, :], embedded).squeeze(1)
        # Mean pooling by dividing by the length
        embedded = embedded / length[:, None]

        if self.normalize:
            return nn.functional.normalize(embedded)
        return embedded

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward pass through the mean, and a classifier layer after."""
        encoded = self._encode(input_ids)
        return self.head(encoded), encoded

    def tokenize(self, encoded_ids: list[list[int]], max_length: int | None = 512) -> torch.Tensor:
        """Pad a bunch of (already tokenized) texts into a single 2D tensor; not used during training."""
        ids = [torch.Tensor(x[:max_length]).long() for x in encoded_ids]
        return pad_sequence(ids, batch_first=True, padding_value=self.pad_id)

    def _prepare_dataset(self, X: list[list[int]], y: torch.Tensor, max_length: int = 512) -> TextDataset:
        """Prepare a dataset (the texts arrive tokenized with add_special_tokens=False)."""
        tokenized = [ids[:max_length] for ids in X]
        if FIXED:
            return TextDataset(tokenized, y, pad_id=self.pad_id)
        return TextDataset(tokenized, y)


# A static model distilled from an XLM-R-style tokenizer: 0 = <s>, 1 = <pad>, 2 = </s>, 3 = <unk>;
# get_probable_pad_token_id(tokenizer) -> tokenizer.padding["pad_id"] == 1.
VOCAB, DIM = 64, 16
PAD_ID = 1
vectors = torch.randn(VOCAB, DIM)
weights = torch.rand(VOCAB) * 0.8 + 0.1  # the distilled token weights, in (0, 1)

model = StaticModelForClassification(vectors=vectors, pad_id=PAD_ID, weights=weights, hidden_dim=32, out_dim=2)

gen = torch.Generator().manual_seed(1)
texts = [torch.randint(4, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(3, 12, (24,), generator=gen)]
labels = torch.tensor([int(sum(t) % 2) for t in texts])

train_dataset = model._prepare_dataset(texts, labels)
loss_function = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

# ClassifierLightningModule.training_step, run by hand for a few epochs
model.train()
torch.manual_seed(2)
for epoch in range(3):
    total = 0.0
    for x, y in train_dataset.to_dataloader(shuffle=True, batch_size=8):
        head_out, _ = model(x)
        loss = loss_function(head_out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
    print(f"epoch {epoch} train_loss {total / 3:.6f}")

model.eval()
with torch.no_grad():
    logits = model.head(model._encode(model.tokenize(texts[:4])))
print("predict logits", logits.numpy().round(4).tolist())
