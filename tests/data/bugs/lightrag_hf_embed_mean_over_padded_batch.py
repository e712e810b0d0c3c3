"""LightRAG's Hugging Face embedding function averages the padded batch, pads included.

Citation: HKUDS/LightRAG#3675 ("fix(hf): exclude padding tokens from embedding pooling"),
lightrag/llm/hf.py ``hf_embed``; the code before the fix is read at commit 85e9f988.

The bug: ``hf_embed`` tokenizes the batch of texts with ``padding=True``, passes ``input_ids`` and
``attention_mask`` to the encoder, then pools with ``outputs.last_hidden_state.mean(dim=1)``: the
hidden states of the [PAD] positions of every text shorter than the longest one in the batch enter
the mean, and the mean is divided by the padded length. A chunk's vector then depends on which other
chunks it was embedded with, and the cosine ranking the vector store returns changes with it.

The fix: expand the attention mask over the hidden dimension, sum only the unmasked hidden states
(accumulated in float32) and divide by the number of unmasked tokens (``clamp_min(1)``), then cast back
to the hidden states' dtype. (The fixed branch follows the PR's description of its change; the merged
diff itself was not available to read.)

Toy sizes, random weights: a 2-layer BertModel (the README's example embedder is
sentence-transformers/all-MiniLM-L6-v2, loaded with AutoModel) and a word-level BERT-style fast
tokenizer ([CLS] ... [SEP], right padding). The vector store is NanoVectorDBStorage's cosine query,
shrunk to a normalised dot product and a top-k.
"""

import asyncio
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

WORDS = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "scrooge", "is", "a", "miser", "who", "hates", "christmas", "marley", "ghost", "visits", "him",
    "on", "eve", "the", "three", "spirits", "show", "past", "present", "and", "future", "tiny", "tim",
    "cratchit", "family", "poor", "but", "happy", "he", "wakes", "changed", "man", "gives", "money",
    "to", "charity", ".", ",", "?", "what", "does", "do", "after", "night",
]


def build_tokenizer():
    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        padding_side="right",
        model_max_length=64,
    )


# ---- lightrag/utils.py ----------------------------------------------------------------------------
@dataclass
class EmbeddingFunc:
    embedding_dim: int
    max_token_size: int
    func: Callable

    async def __call__(self, *args, **kwargs) -> np.ndarray:
        return await self.func(*args, **kwargs)


# ---- lightrag/llm/hf.py -------------------------------------------------------------------------
async def hf_embed(texts: list[str], tokenizer, embed_model) -> np.ndarray:
    # Detect the appropriate device
    if torch.cuda.is_available():
        device = next(embed_model.parameters()).device  # Use CUDA if available
    else:
        device = torch.device("cpu")  # Fallback to CPU

    # Move the model to the detected device
    embed_model = embed_model.to(device)

    # Tokenize the input texts and move them to the same device
    encoded_texts = tokenizer(
        texts, return_tensors="pt", padding=True, truncation=True
    ).to(device)

    # Perform inference
    with torch.no_grad():
        outputs = embed_model(
            input_ids=encoded_texts["input_ids"],
            attention_mask=encoded_texts["attention_mask"],
        )
        if FIXED:
            last_hidden_state = outputs.last_hidden_state
            attention_mask = encoded_texts["attention_mask"]
            mask = attention_mask.unsqueeze(-1).expand(last_hidden_state.size()).to(torch.float32)
            summed = (last_hidden_state.to(torch.float32) * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp_min(1)
            embeddings = (summed / counts).to(last_hidden_state.dtype)
        else:
            embeddings = outputs.last_hidden_state.mean(dim=1)

    # Convert embeddings to NumPy
    if embeddings.dtype == torch.bfloat16:
        return embeddings.detach().to(torch.float32).cpu().numpy()
    else:
        return embeddings.detach().cpu().numpy()


# ---- lightrag/kg/nano_vector_db_impl.py (upsert / query), shrunk ---------------------------------
class NanoVectorDBStorage:
    def __init__(self, embedding_func, embedding_batch_num=4, cosine_better_than_threshold=-1.0):
        self.embedding_func = embedding_func
        self._max_batch_size = embedding_batch_num
        self.cosine_better_than_threshold = cosine_better_than_threshold
        self._ids = []
        self._matrix = None

    async def upsert(self, data: dict[str, dict]):
        list_data = [{"__id__": k, "content": v["content"]} for k, v in data.items()]
        contents = [v["content"] for v in data.values()]
        batches = [contents[i : i + self._max_batch_size] for i in range(0, len(contents), self._max_batch_size)]
        embeddings_list = await asyncio.gather(*[self.embedding_func(batch) for batch in batches])
        embeddings = np.concatenate(embeddings_list)
        self._ids = [d["__id__"] for d in list_data]
        self._matrix = embeddings / np.linalg.norm(embeddings, axis=-1, keepdims=True)
        return embeddings

    async def query(self, query: str, top_k: int):
        embedding = (await self.embedding_func([query]))[0]
        embedding = embedding / np.linalg.norm(embedding)
        scores = self._matrix @ embedding
        order = np.argsort(-scores)[:top_k]
        return [
            {"id": self._ids[i], "distance": float(scores[i])}
            for i in order
            if scores[i] > self.cosine_better_than_threshold
        ]


async def main():
    tokenizer = build_tokenizer()
    config = BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
    )
    embed_model = BertModel(config, add_pooling_layer=False).eval()

    embedding_func = EmbeddingFunc(
        embedding_dim=config.hidden_size,
        max_token_size=64,
        func=lambda texts: hf_embed(texts, tokenizer=tokenizer, embed_model=embed_model),
    )

    chunk_texts = [
        "scrooge is a miser who hates christmas .",
        "marley ghost visits him on christmas eve .",
        "the three spirits show him christmas past , christmas present and christmas future , "
        "tiny tim and the cratchit family , poor but happy .",
        "he wakes a changed man .",
        "scrooge gives money to charity .",
        "tiny tim .",
    ]
    chunks = {f"chunk-{i}": {"content": text} for i, text in enumerate(chunk_texts)}
    db = NanoVectorDBStorage(embedding_func, embedding_batch_num=3)
    embeddings = await db.upsert(chunks)
    print("chunk embeddings[:, :4]:\n", np.round(embeddings[:, :4], 4))

    results = await db.query("what does scrooge do after christmas eve ?", top_k=6)
    for r in results:
        print(f"{r['id']}: {r['distance']:.4f}")


if __name__ == "__main__":
    asyncio.run(main())
