# Citation: QwenLM/Qwen3-Embedding @f4ad0c434c0e3534494e26a4a6bdfd8ab1431968:
#   examples/qwen3_embedding_transformers.py (Qwen3Embedding: tokenizer loaded with padding_side='left',
#   last_token_pool, get_detailed_instruct, encode with MRL `dim` truncation then F.normalize, scores = q @ d.T * 100)
#   and evaluation/qwen3_embedding_model.py (TransformersTextEmbedder: tokenizer.padding_side = "left",
#   tokenize with the instruction prompt prefixed and truncation to max_length, _pooling_last, truncate_dim, do_norm).
# Qwen3-Embedding is a causal Qwen3 decoder read out at its last token. The tokenizer appends <|endoftext|> to
# every text (its post-processor), and the same token is the pad token; padding is on the left, so
# attention_mask[:, -1] is all ones and last_token_pool takes hidden[:, -1] (the right-padded branch indexes
# attention_mask.sum(1) - 1). The model is transformers' Qwen3Model (SDPA, causal + the tokenizer's padding mask,
# default position ids), built tiny from a Qwen3Config with random weights and saved with a byte-level BPE
# tokenizer to a temporary directory, so both classes load it through AutoModel / AutoTokenizer as they do.
# Checked against each text embedded alone (a batch of one, no padding): queries with the instruction, documents,
# a truncated document, the MRL-truncated vectors, the score matrix, and the right-padded branch of the pool.
import tempfile
from typing import List, Union

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from torch import Tensor
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3Model
from transformers.tokenization_utils_base import BatchEncoding

torch.manual_seed(0)


class Qwen3Embedding():
    def __init__(self, model_name_or_path, instruction=None, use_fp16: bool = True, use_cuda: bool = True, max_length=8192):
        if instruction is None:
            instruction = 'Given a web search query, retrieve relevant passages that answer the query'
        self.instruction = instruction
        self.model = AutoModel.from_pretrained(model_name_or_path, trust_remote_code=True,
                                               dtype=torch.float16 if use_fp16 else torch.float32)
        if use_cuda:
            self.model = self.model.cuda()
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=True, padding_side='left')
        self.max_length = max_length

    def last_token_pool(self, last_hidden_states: Tensor,
                        attention_mask: Tensor) -> Tensor:
        left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
        if left_padding:
            return last_hidden_states[:, -1]
        else:
            sequence_lengths = attention_mask.sum(dim=1) - 1
            batch_size = last_hidden_states.shape[0]
        return last_hidden_states[torch.arange(batch_size, device=last_hidden_states.device), sequence_lengths]

    def get_detailed_instruct(self, task_description: str, query: str) -> str:
        if task_description is None:
            task_description = self.instruction
        return f'Instruct: {task_description}\nQuery:{query}'

    def encode(self, sentences: Union[List[str], str], is_query: bool = False, instruction=None, dim: int = -1):
        if isinstance(sentences, str):
            sentences = [sentences]
        if is_query:
            sentences = [self.get_detailed_instruct(instruction, sent) for sent in sentences]
        inputs = self.tokenizer(sentences, padding=True, truncation=True, max_length=self.max_length, return_tensors='pt')
        inputs.to(self.model.device)
        with torch.no_grad():
            model_outputs = self.model(**inputs)
            output = self.last_token_pool(model_outputs.last_hidden_state, inputs['attention_mask'])
            if dim != -1:
                output = output[:, :dim]
            output = F.normalize(output, p=2, dim=1)
        return output


class TransformersTextEmbedder(torch.nn.Module):
    def __init__(self, model: str, pooler_type: str = 'last', do_norm: bool = False, truncate_dim: int = 0,
                 padding_left: bool = False, attn_type: str = 'causal', **kwargs):
        super().__init__()
        self.base_model = AutoModel.from_pretrained(model, **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(model, **kwargs)
        self.tokenizer.padding_side = "left"
        self.pooler_type = pooler_type
        self.do_norm = do_norm
        self.truncate_dim = truncate_dim
        self.padding_left = padding_left
        self.attn_type = attn_type
        if pooler_type == 'first':
            assert padding_left is False
            self.pooling = self._pooling_first
        elif pooler_type == 'last':
            self.pooling = self._pooling_last
        elif pooler_type == 'mean':
            self.pooling = self._pooling_mean
        else:
            raise ValueError(f"Wrong pooler : {self.pooler_type}")

    def embed(self, sentences, max_length: int, prompt: str = None, device='cpu') -> torch.Tensor:
        inputs = self.tokenize(sentences, max_length, prompt).to(device)
        embeddings = self.forward(**inputs.data)
        return embeddings

    def tokenize(self, texts, max_length: int, prompt=None) -> BatchEncoding:
        if prompt:
            texts = [prompt + t for t in texts]
        inputs = self.tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors='pt')
        return inputs

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        output = self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            return_dict=True,
            **kwargs
        )
        embeddings = self.pooling(output.last_hidden_state, attention_mask)
        if self.truncate_dim > 0:
            embeddings = embeddings[:, :self.truncate_dim]
        if self.do_norm:
            embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
        return embeddings

    @staticmethod
    def _pooling_last(hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask
        left_padding = (mask[:, -1].sum() == mask.shape[0])
        if left_padding:
            return hidden_state[:, -1]
        else:
            sequence_lengths = mask.sum(dim=1) - 1
            batch_size = hidden_state.shape[0]
            return hidden_state[torch.arange(batch_size, device=hidden_state.device), sequence_lengths]

    @staticmethod
    def _pooling_first(hidden_state: torch.Tensor, _) -> torch.Tensor:
        return hidden_state[:, 0]

    @staticmethod
    def _pooling_mean(hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert attention_mask.ndim == 2, f"Unexpected {attention_mask.ndim=}"
        attention_mask = attention_mask.float()
        lengths = attention_mask.sum(1)
        pooled_output = torch.einsum('bsh,bs,b->bh', (hidden_state.float(), attention_mask, 1 / lengths))
        return pooled_output


def build_tiny_checkpoint(path):
    # A byte-level BPE (no merges) with Qwen's special tokens; the post-processor appends <|endoftext|>, which is
    # also the pad token, as in the Qwen3-Embedding tokenizer.
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        vocab[special] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0",
        pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", vocab["<|endoftext|>"])],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=512,
    )
    config = Qwen3Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=True, pad_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|endoftext|>"], attn_implementation="sdpa",
    )
    model = Qwen3Model(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def embed_alone(model, tokenizer, texts, max_length, dim=-1):
    # Reference: one text at a time, no padding, read out at its last (EOS) token.
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors='pt')
            assert ids['attention_mask'].all()
            hidden = model(input_ids=ids['input_ids']).last_hidden_state[0, -1]
            rows.append(hidden if dim == -1 else hidden[:dim])
    return F.normalize(torch.stack(rows), p=2, dim=1)


def check(name, got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    print(f"{name}: max abs err {err:.2e}")
    assert err < tol, name


if __name__ == "__main__":
    queries = ['What is the capital of China?', 'Explain gravity', 'how do tides work near the equator?',
               'Paris']
    documents = [
        "The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other. It gives weight to physical objects and "
        "is responsible for the movement of planets around the sun.",
        "Tides.",
        "The Moon's gravity pulls the oceans into two bulges, and the Earth turns beneath them twice a day, "
        "which is why most coasts see two high tides and two low tides; near the equator the range is small.",
    ]
    with tempfile.TemporaryDirectory() as model_path:
        build_tiny_checkpoint(model_path)

        model = Qwen3Embedding(model_path, use_fp16=False, use_cuda=False, max_length=160)
        dim = 32
        query_outputs = model.encode(queries, is_query=True)
        doc_outputs = model.encode(documents)
        query_small = model.encode(queries, is_query=True, dim=dim)
        scores = (query_outputs @ doc_outputs.T) * 100
        print(scores.tolist())

        batch = model.tokenizer([model.get_detailed_instruct(None, q) for q in queries], padding=True,
                                truncation=True, max_length=model.max_length, return_tensors='pt')
        assert model.tokenizer.padding_side == 'left' and not batch['attention_mask'][:, 0].all()
        assert (batch['input_ids'][:, -1] == model.tokenizer.eos_token_id).all()
        doc_lens = model.tokenizer(documents, truncation=True, max_length=model.max_length)['input_ids']
        assert max(len(ids) for ids in doc_lens) == model.max_length  # the last document is truncated

        detailed = [model.get_detailed_instruct(None, q) for q in queries]
        query_ref = embed_alone(model.model, model.tokenizer, detailed, model.max_length)
        doc_ref = embed_alone(model.model, model.tokenizer, documents, model.max_length)
        check("queries (instruct, left padded)", query_outputs, query_ref)
        check("documents (left padded, one truncated)", doc_outputs, doc_ref)
        check("queries at dim=32", query_small,
              embed_alone(model.model, model.tokenizer, detailed, model.max_length, dim=dim))
        check("scores", scores, (query_ref @ doc_ref.T) * 100, tol=1e-3)

        # The other branch of last_token_pool: the same documents padded on the right.
        model.tokenizer.padding_side = 'right'
        check("documents (right padded)", model.encode(documents), doc_ref)
        model.tokenizer.padding_side = 'left'

        # The MTEB evaluation wrapper's embedder, as run_mteb.py drives it: instruction prompt, max_length, MRL.
        instruction_template = "Instruct: {}\nQuery:"
        prompt = instruction_template.format("Retrieve semantically similar text")
        embedder = TransformersTextEmbedder(model_path, pooler_type='last', do_norm=True, truncate_dim=dim,
                                            padding_left=True, dtype=torch.float32).eval()
        with torch.inference_mode():
            sts = embedder.embed(queries + documents, max_length=96, prompt=prompt)
        sts_ref = embed_alone(embedder.base_model, embedder.tokenizer, [prompt + t for t in queries + documents],
                              96, dim=dim)
        check("evaluation embedder (prompt, max_length=96, truncate_dim=32)", sts, sts_ref)
    print("ok")
