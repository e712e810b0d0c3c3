# Correct program (quiet batch quiet-r67b).
# Ported from Muennighoff/sgpt @37c8bf090af8fe3d2d553b5281cf8ef7205e4d01:
#   biencoder/nli_msmarco/sentence-transformers/sentence_transformers/models/Transformer.py (Transformer.forward,
#     tokenize, tokenize_bos_eos: the text tokenized with padding=False, the [SOS] / {SOS} marker replaced by the
#     "[" / "{" bracket id, the closing "]" / "}" appended with attention 1, then tokenizer.pad(padding=True)),
#   biencoder/nli_msmarco/sentence-transformers/sentence_transformers/models/Pooling.py (Pooling.forward,
#     pooling_mode 'weightedmean': position weights arange(1, seq_len + 1) multiplied into the attention mask, the sum
#     divided by the summed weights; 'mean' the same without weights),
#   biencoder/nli_msmarco/sentence-transformers/sentence_transformers/losses/MultipleNegativesRankingLoss.py
#     (single-process branch: cos_sim(anchors, positives + hard negatives) * scale, cross entropy on the diagonal),
#   biencoder/nli_msmarco/sentence-transformers/examples/training/ms_marco/train_bi-encoder_mnrl.py (--specb: the
#     [SOS] / {SOS} tokens added and the bracket ids set on the Transformer module, replace_bos=True, "[SOS]" + query,
#     "{SOS}" + passage, tokenizer.pad_token = tokenizer.eos_token for GPT models),
#   README.md "Asymmetric Semantic Search BE" (tokenize_with_specb and get_weightedmean_embedding over the plain
#     Hugging Face model).
# The GPT-Neo backbone is a tiny GPTNeoConfig (a global and a local layer, window 3) built in memory; the tokenizer is
# a word-level PreTrainedTokenizerFast built in memory with GPT's <|endoftext|> as eos and pad. Queries and documents
# of unequal lengths are right-padded with the eos id, attention 0 on the pads; the causal model's real tokens never
# look right, and the weighted mean gives the pads weight 0 and the real tokens their 1-based positions.
# Self-check: every text alone, unpadded and with no mask, through the same GPTNeoModel; its embedding is
# sum_t t * h_t / sum_t t over its own tokens (a Python loop). The batch's query / document embeddings (training-time
# and README paths, which must also agree with each other), the MNRL score matrix and its loss must match.
import sys
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPTNeoConfig, GPTNeoModel, PreTrainedTokenizerFast

torch.manual_seed(0)


# --- sentence_transformers/models/Transformer.py (model and tokenizer handed in instead of from_pretrained) ---
class Transformer(nn.Module):
    def __init__(self, auto_model, tokenizer, max_seq_length: Optional[int] = None, do_lower_case: bool = False,
                 bos_spec_token_q=None, eos_spec_token_q=None,
                 bos_spec_token_d=None, eos_spec_token_d=None,
                 replace_bos=False,
                 bos_spec_token_q_rep=None,
                 bos_spec_token_d_rep=None):
        super(Transformer, self).__init__()
        self.config_keys = ['max_seq_length', 'do_lower_case']
        self.do_lower_case = do_lower_case
        self.auto_model = auto_model
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length

        # Set these in the script if needed
        self.bos_spec_token_q = bos_spec_token_q
        self.eos_spec_token_q = eos_spec_token_q
        self.bos_spec_token_d = bos_spec_token_d
        self.eos_spec_token_d = eos_spec_token_d

        self.replace_bos = replace_bos
        self.bos_spec_token_q_rep = bos_spec_token_q_rep
        self.bos_spec_token_d_rep = bos_spec_token_d_rep

    def forward(self, features):
        """Returns token_embeddings, cls_token"""
        trans_features = {'input_ids': features['input_ids'], 'attention_mask': features['attention_mask']}
        if 'token_type_ids' in features:
            trans_features['token_type_ids'] = features['token_type_ids']

        output_states = self.auto_model(**trans_features, return_dict=False)
        output_tokens = output_states[0]

        features.update({'token_embeddings': output_tokens, 'attention_mask': features['attention_mask']})
        return features

    def get_word_embedding_dimension(self) -> int:
        return self.auto_model.config.hidden_size

    def tokenize(self, texts: Union[List[str], List[Dict], List[Tuple[str, str]]]):
        """
        Tokenizes a text and maps tokens to token-ids
        """
        output = {}
        if isinstance(texts[0], str):
            to_tokenize = [texts]
        else:
            batch1, batch2 = [], []
            for text_tuple in texts:
                batch1.append(text_tuple[0])
                batch2.append(text_tuple[1])
            to_tokenize = [batch1, batch2]

        #strip
        to_tokenize = [[str(s).strip() for s in col] for col in to_tokenize]

        #Lowercase
        if self.do_lower_case:
            to_tokenize = [[s.lower() for s in col] for col in to_tokenize]

        # Transfomers never adds special tokens for GPT models - https://github.com/huggingface/transformers/issues/3311
        # hence we add them manually here:
        if (self.bos_spec_token_q is not None) and \
           (self.eos_spec_token_q is not None) and \
           (self.bos_spec_token_d is not None) and \
           (self.eos_spec_token_d is not None):
            output.update(self.tokenize_bos_eos(to_tokenize))
        else:
            output.update(self.tokenizer(*to_tokenize, padding=True, truncation='longest_first', return_tensors="pt", max_length=self.max_seq_length))

        return output

    def tokenize_bos_eos(self, to_tokenize):
        out = self.tokenizer(*to_tokenize,
                            padding=False,
                            truncation='longest_first',
                            max_length=self.max_seq_length-2)
        for seq, att in zip(out["input_ids"], out["attention_mask"]):
            if seq[0] == self.bos_spec_token_d:
                # Replace with a different doc token if given
                if self.replace_bos:
                    seq[0] = self.bos_spec_token_d_rep
                seq.append(self.eos_spec_token_d)
            elif seq[0] == self.bos_spec_token_q:
                # Replace with a different query token if given
                if self.replace_bos:
                    seq[0] = self.bos_spec_token_q_rep
                seq.append(self.eos_spec_token_q)
            else:
                raise ValueError(f"Did not find BOS Token in sequence: {self.tokenizer.decode(seq)}")
            att.append(1)
        return self.tokenizer.pad(out, padding=True, return_tensors="pt")


# --- sentence_transformers/models/Pooling.py (the modes this program uses) ---
class Pooling(nn.Module):
    def __init__(self,
                 word_embedding_dimension: int,
                 pooling_mode: str = None,
                 pooling_mode_cls_token: bool = False,
                 pooling_mode_max_tokens: bool = False,
                 pooling_mode_mean_tokens: bool = True,
                 pooling_mode_mean_sqrt_len_tokens: bool = False,
                 pooling_mode_weightedmean_tokens: bool = False,
                 ):
        super(Pooling, self).__init__()

        if pooling_mode is not None:        #Set pooling mode by string
            pooling_mode = pooling_mode.lower()
            assert pooling_mode in ['mean', 'max', 'cls', 'weightedmean']
            pooling_mode_cls_token = (pooling_mode == 'cls')
            pooling_mode_max_tokens = (pooling_mode == 'max')
            pooling_mode_mean_tokens = (pooling_mode == 'mean')

            pooling_mode_weightedmean_tokens = (pooling_mode == 'weightedmean')

        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = pooling_mode_cls_token
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens
        self.pooling_mode_max_tokens = pooling_mode_max_tokens
        self.pooling_mode_mean_sqrt_len_tokens = pooling_mode_mean_sqrt_len_tokens
        self.pooling_mode_weightedmean_tokens = pooling_mode_weightedmean_tokens

    def forward(self, features: Dict[str, Tensor]):
        token_embeddings = features['token_embeddings']
        attention_mask = features['attention_mask']

        ## Pooling strategy
        output_vectors = []
        if self.pooling_mode_cls_token:
            cls_token = features.get('cls_token_embeddings', token_embeddings[:, 0])  # Take first token by default
            output_vectors.append(cls_token)
        if self.pooling_mode_max_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            token_embeddings[input_mask_expanded == 0] = -1e9  # Set padding tokens to large negative value
            max_over_time = torch.max(token_embeddings, 1)[0]
            output_vectors.append(max_over_time)
        if self.pooling_mode_mean_tokens or self.pooling_mode_mean_sqrt_len_tokens or self.pooling_mode_weightedmean_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()

            if self.pooling_mode_weightedmean_tokens:
                # token_embeddings shape: bs, seq, hidden_dim
                weights = (
                        torch.arange(start=1, end=token_embeddings.shape[1] + 1)
                        .unsqueeze(0)
                        .unsqueeze(-1)
                        .expand(token_embeddings.size())
                        .float().to(token_embeddings.device)
                    )
                assert weights.shape == token_embeddings.shape == input_mask_expanded.shape
                input_mask_expanded = input_mask_expanded * weights

            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            #If tokens are weighted (by WordWeights layer), feature 'token_weights_sum' will be present
            if 'token_weights_sum' in features:
                sum_mask = features['token_weights_sum'].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)

            if self.pooling_mode_mean_tokens or self.pooling_mode_weightedmean_tokens:
                output_vectors.append(sum_embeddings / sum_mask)
            if self.pooling_mode_mean_sqrt_len_tokens:
                output_vectors.append(sum_embeddings / torch.sqrt(sum_mask))

        output_vector = torch.cat(output_vectors, 1)
        features.update({'sentence_embedding': output_vector})
        return features


# --- sentence_transformers/SentenceTransformer.py (the two-module Sequential and smart_batching_collate, trimmed) ---
class SentenceTransformer(nn.Sequential):
    def tokenize(self, texts):
        return self[0].tokenize(texts)

    def smart_batching_collate(self, batch):
        num_texts = len(batch[0]["texts"])
        texts = [[] for _ in range(num_texts)]
        labels = []
        for example in batch:
            for idx, text in enumerate(example["texts"]):
                texts[idx].append(text)
            labels.append(example["label"])
        labels = torch.tensor(labels)
        sentence_features = []
        for idx in range(num_texts):
            tokenized = self.tokenize(texts[idx])
            sentence_features.append(tokenized)
        return sentence_features, labels


def cos_sim(a: Tensor, b: Tensor):
    a_norm = torch.nn.functional.normalize(a, p=2, dim=1)
    b_norm = torch.nn.functional.normalize(b, p=2, dim=1)
    return torch.mm(a_norm, b_norm.transpose(0, 1))


# --- sentence_transformers/losses/MultipleNegativesRankingLoss.py (single process) ---
class MultipleNegativesRankingLoss(nn.Module):
    def __init__(self, model: SentenceTransformer, scale: float = 20.0, similarity_fct = cos_sim):
        super(MultipleNegativesRankingLoss, self).__init__()
        self.model = model
        self.scale = scale
        self.similarity_fct = similarity_fct
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, sentence_features, labels: Tensor):
        reps = [self.model(sentence_feature)['sentence_embedding'] for sentence_feature in sentence_features]
        embeddings_a = reps[0]
        candidates = torch.cat(reps[1:])
        scores = self.similarity_fct(embeddings_a, candidates) * self.scale
        labels = torch.tensor(range(len(scores)), dtype=torch.long,
                              device=scores.device)  # Example a[i] should match with b[i]
        return self.cross_entropy_loss(scores, labels), scores


# --- README.md, "Asymmetric Semantic Search BE" (tokenizer and model passed in) ---
def tokenize_with_specb(tokenizer, texts, is_query, SPECB_QUE_BOS, SPECB_QUE_EOS, SPECB_DOC_BOS, SPECB_DOC_EOS):
    # Tokenize without padding
    batch_tokens = tokenizer(texts, padding=False, truncation=True)
    # Add special brackets & pay attention to them
    for seq, att in zip(batch_tokens["input_ids"], batch_tokens["attention_mask"]):
        if is_query:
            seq.insert(0, SPECB_QUE_BOS)
            seq.append(SPECB_QUE_EOS)
        else:
            seq.insert(0, SPECB_DOC_BOS)
            seq.append(SPECB_DOC_EOS)
        att.insert(0, 1)
        att.append(1)
    # Add padding
    batch_tokens = tokenizer.pad(batch_tokens, padding=True, return_tensors="pt")
    return batch_tokens


def get_weightedmean_embedding(batch_tokens, model):
    # Get the embeddings
    with torch.no_grad():
        # Get hidden state of shape [bs, seq_len, hid_dim]
        last_hidden_state = model(**batch_tokens, output_hidden_states=True, return_dict=True).last_hidden_state

    # Get weights of shape [bs, seq_len, hid_dim]
    weights = (
        torch.arange(start=1, end=last_hidden_state.shape[1] + 1)
        .unsqueeze(0)
        .unsqueeze(-1)
        .expand(last_hidden_state.size())
        .float().to(last_hidden_state.device)
    )

    # Get attn mask of shape [bs, seq_len, hid_dim]
    input_mask_expanded = (
        batch_tokens["attention_mask"]
        .unsqueeze(-1)
        .expand(last_hidden_state.size())
        .float()
    )

    # Perform weighted mean pooling across seq_len: bs, seq_len, hidden_dim -> bs, hidden_dim
    sum_embeddings = torch.sum(last_hidden_state * input_mask_expanded * weights, dim=1)
    sum_mask = torch.sum(input_mask_expanded * weights, dim=1)

    embeddings = sum_embeddings / sum_mask

    return embeddings


# --- an in-memory GPT-style word-level tokenizer (no BOS / EOS added, like GPT-2's) ---
WORDS = ("i am searching for a planet not too far from earth neptune is the eighth and farthest known solar "
         "sun in system it fourth largest by diameter small exoplanet orbits on inner edge of habitable zone "
         "harsh desert world orbiting twin suns galaxy outer rim where do dogs sleep cats like milk at night "
         "what which star closest to us . , ? [ ] { }").split()


def build_tokenizer():
    vocab = {t: i for i, t in enumerate(["<|endoftext|>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", padding_side="right",
                                   model_input_names=["input_ids", "attention_mask"])


def reference_weightedmean(auto_model, ids, weighted=True):
    # one text alone: no padding, no attention mask, a loop over its own positions
    h = auto_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    num = torch.zeros(h.shape[-1])
    den = 0.0
    for t in range(len(ids)):
        w = float(t + 1) if weighted else 1.0
        num = num + w * h[t]
        den += w
    return num / den


def main():
    tokenizer = build_tokenizer()
    # train_bi-encoder_mnrl.py, --specb, "gpt" in model_name
    tokenizer.pad_token = tokenizer.eos_token
    tokens = ["[SOS]", "{SOS}"]
    tokenizer.add_tokens(tokens, special_tokens=True)

    config = GPTNeoConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4,
                          attention_types=[[["global", "local"], 1]], window_size=3, max_position_embeddings=64,
                          intermediate_size=64, bos_token_id=tokenizer.eos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    auto_model = GPTNeoModel(config).eval()

    word_embedding_model = Transformer(auto_model, tokenizer, max_seq_length=48)
    # Will be replaced with the rep tokens in the model ones
    word_embedding_model.bos_spec_token_q = word_embedding_model.tokenizer.encode("[SOS]", add_special_tokens=False)[0]
    word_embedding_model.bos_spec_token_d = word_embedding_model.tokenizer.encode("{SOS}", add_special_tokens=False)[0]

    word_embedding_model.bos_spec_token_q_rep = word_embedding_model.tokenizer.encode("[", add_special_tokens=False)[0]
    word_embedding_model.eos_spec_token_q = word_embedding_model.tokenizer.encode("]", add_special_tokens=False)[0]

    word_embedding_model.bos_spec_token_d_rep = word_embedding_model.tokenizer.encode("{", add_special_tokens=False)[0]
    word_embedding_model.eos_spec_token_d = word_embedding_model.tokenizer.encode("}", add_special_tokens=False)[0]

    word_embedding_model.replace_bos = True

    pooling_model = Pooling(word_embedding_model.get_word_embedding_dimension(), "weightedmean")
    model = SentenceTransformer(word_embedding_model, pooling_model).eval()
    train_loss = MultipleNegativesRankingLoss(model=model)

    raw = [
        ("which star is closest to us ?", "the sun is the closest star to earth .",
         "neptune is the eighth and farthest known solar planet from the sun"),
        ("where do dogs sleep", "dogs sleep in the inner zone of the world at night .", "cats like milk"),
        ("i am searching for a planet not too far from earth .",
         "a small exoplanet orbits on the inner edge of the habitable zone .",
         "a harsh desert world orbiting twin suns in the galaxy outer rim ."),
        ("what is it", "it is a planet", "what orbits the sun in the solar system , by diameter the fourth largest ?"),
    ]
    # "[SOS]" + query, "{SOS}" + passage, as the training script reads them
    batch = [{"texts": ["[SOS]" + q, "{SOS}" + p, "{SOS}" + n], "label": 0} for q, p, n in raw]

    with torch.no_grad():
        sentence_features, labels = model.smart_batching_collate(batch)
        for feats in sentence_features:
            assert not bool(feats["attention_mask"].all())           # every column is right-padded
            assert bool((feats["attention_mask"][:, 0] == 1).all())
        loss, scores = train_loss(sentence_features, labels)
        emb = [f["sentence_embedding"] for f in sentence_features]

        # the reference: every text alone, [ / { + text + ] / }, unpadded, no mask
        def ids_of(text, is_query):
            body = tokenizer(text, add_special_tokens=False)["input_ids"]
            if is_query:
                return [word_embedding_model.bos_spec_token_q_rep] + body + [word_embedding_model.eos_spec_token_q]
            return [word_embedding_model.bos_spec_token_d_rep] + body + [word_embedding_model.eos_spec_token_d]

        ref = [torch.stack([reference_weightedmean(auto_model, ids_of(r[c], c == 0)) for r in raw]) for c in range(3)]
        for c in range(3):
            assert torch.allclose(emb[c], ref[c], atol=1e-5), (c, (emb[c] - ref[c]).abs().max())

        bs = len(raw)
        cands = torch.cat([ref[1], ref[2]])
        ref_scores = torch.zeros(bs, 2 * bs)
        for i in range(bs):
            for j in range(2 * bs):
                a, b = ref[0][i], cands[j]
                ref_scores[i, j] = 20.0 * torch.dot(a, b) / (a.norm() * b.norm())
        ref_loss = sum(-(ref_scores[i, i] - torch.logsumexp(ref_scores[i], 0)) for i in range(bs)) / bs
        assert torch.allclose(scores, ref_scores, atol=1e-4), (scores - ref_scores).abs().max()
        assert abs(loss.item() - float(ref_loss)) < 1e-5, (loss.item(), float(ref_loss))

        # README path: brackets inserted around plain text, the HF model called directly
        SPECB_QUE_BOS = tokenizer.encode("[", add_special_tokens=False)[0]
        SPECB_QUE_EOS = tokenizer.encode("]", add_special_tokens=False)[0]
        SPECB_DOC_BOS = tokenizer.encode("{", add_special_tokens=False)[0]
        SPECB_DOC_EOS = tokenizer.encode("}", add_special_tokens=False)[0]
        specb = (SPECB_QUE_BOS, SPECB_QUE_EOS, SPECB_DOC_BOS, SPECB_DOC_EOS)
        queries = [r[0] for r in raw]
        docs = [r[1] for r in raw] + [r[2] for r in raw]
        q_tok = tokenize_with_specb(tokenizer, queries, True, *specb)
        d_tok = tokenize_with_specb(tokenizer, docs, False, *specb)
        assert not bool(q_tok["attention_mask"].all()) and not bool(d_tok["attention_mask"].all())
        query_embeddings = get_weightedmean_embedding(q_tok, auto_model)
        doc_embeddings = get_weightedmean_embedding(d_tok, auto_model)
        assert torch.allclose(query_embeddings, ref[0], atol=1e-5), (query_embeddings - ref[0]).abs().max()
        assert torch.allclose(doc_embeddings, cands, atol=1e-5), (doc_embeddings - cands).abs().max()
        # the README ranks documents by cosine similarity
        sim = F.cosine_similarity(query_embeddings[:, None], doc_embeddings[None], dim=-1)
        assert torch.allclose(sim * 20.0, ref_scores, atol=1e-4)

        # plain mean pooling over the same right-padded batch (pooling_mode 'mean')
        mean_model = SentenceTransformer(word_embedding_model, Pooling(32, "mean")).eval()
        feats = mean_model.tokenize(["{SOS}" + d for d in docs])
        mean_emb = mean_model(feats)["sentence_embedding"]
        ref_mean = torch.stack([reference_weightedmean(auto_model, ids_of(d, False), weighted=False) for d in docs])
        assert torch.allclose(mean_emb, ref_mean, atol=1e-5), (mean_emb - ref_mean).abs().max()

    print(f"MNRL loss {loss.item():.6f} == per-text unpadded reference {float(ref_loss):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
