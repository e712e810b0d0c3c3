"""ColPali training collator: left-padded query batch sliced by a fixed image prefix length.

Citation: illuin-tech/colpali#12 ("Query preprocessing"), fixed in illuin-tech/colpali#23 (commit f961263,
"Bug fixes + hard negative", release 0.2.0): colpali_engine/dataset/custom_collator.py
(CustomCollator.forward_vision_pali), colpali_engine/models/paligemma_colbert_architecture.py (ColPali),
colpali_engine/trainer/contrastive_trainer.py (ContrastiveTrainer.compute_loss),
colpali_engine/loss/colbert_loss.py (ColbertPairwiseCELoss).

The bug: queries go through the PaliGemmaProcessor together with a dummy image, so every row is
``<image> * image_seq_length + <bos> + "Question: ..." + "\\n"``, then the collator drops the image prefix
with ``input_ids[..., image_seq_length:]`` (and the same slice of ``attention_mask``). The PaliGemma
tokenizer pads on the left, so in a batch of queries of different lengths the padding sits before the
image tokens: the fixed slice removes the pads plus only part of the image prefix of the shorter
queries, and their leftover ``<image>`` tokens stay in the query with attention_mask 1. They are
attended by the causal Gemma decoder and they are scored as query vectors in the MaxSim.

The fix (changelog 0.2.0: "Set padding side to right in the tokenizer to fix misalignement issue
between different query lengths in the same batch"): the collator sets
``processor.tokenizer.padding_side = "right"``, so the slice removes exactly the image prefix and the
batch padding stays at the end with attention_mask 0. The same commit replaced the five ``<unused0>``
query-augmentation tokens by a suffix of ten ``<pad>`` tokens (add_suffix=True by default).

Toy sizes, random weights; the PaliGemma tokenizer and image processor are replaced by a word-level
fast tokenizer and a resize/normalise step; the SigLIP tower and Gemma decoder are transformers'
PaliGemmaForConditionalGeneration built from tiny configs.
"""

import sys

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import GemmaConfig, PaliGemmaConfig, PreTrainedTokenizerFast, SiglipVisionConfig
from transformers.models.paligemma.modeling_paligemma import (
    PaliGemmaForConditionalGeneration,
    PaliGemmaPreTrainedModel,
)

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---- stand-in for the google/paligemma-3b-mix-448 processor (tokenizer pads on the left) -------------
IMAGE_TOKEN = "<image>"
WORDS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<unused0>", IMAGE_TOKEN, "\n",
    "Question", ":", "Describe", "the", "image", ".", "?", ",",
    "what", "is", "total", "revenue", "in", "2019", "who", "signed", "letter", "of", "company",
    "which", "table", "shows", "yearly", "rainfall", "for", "northern", "region", "how", "many",
    "employees", "are", "listed", "page", "three",
]


def build_paligemma_tokenizer():
    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=[IMAGE_TOKEN, "<unused0>"],
        padding_side="left",
    )
    tokenizer.add_tokens(["\n"])
    return tokenizer


class SiglipImageProcessorStub:
    def __init__(self, size):
        self.size = size

    def __call__(self, images, return_tensors="pt"):
        arrays = []
        for image in images:
            image = image.resize((self.size, self.size))
            array = np.asarray(image, dtype=np.float32) / 255.0
            array = (array - 0.5) / 0.5
            arrays.append(array.transpose(2, 0, 1))
        return {"pixel_values": torch.tensor(np.stack(arrays))}


def build_string_from_input(prompt, bos_token, image_seq_len, image_token):
    return f"{image_token * image_seq_len}{bos_token}{prompt}\n"


class PaliGemmaProcessor:
    def __init__(self, image_processor, tokenizer, image_seq_length):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_seq_length = image_seq_length

    def __call__(self, text=None, images=None, return_tensors="pt", padding="longest", max_length=None,
                 truncation=None):
        input_strings = [
            build_string_from_input(
                prompt=prompt,
                bos_token=self.tokenizer.bos_token,
                image_seq_len=self.image_seq_length,
                image_token=IMAGE_TOKEN,
            )
            for prompt in text
        ]
        pixel_values = self.image_processor(images, return_tensors=return_tensors)["pixel_values"]
        inputs = self.tokenizer(
            input_strings,
            padding=padding,
            max_length=max_length,
            truncation=truncation,
            add_special_tokens=False,
            return_tensors=return_tensors,
        )
        return {**inputs, "pixel_values": pixel_values}


# ---- colpali_engine/dataset/custom_collator.py -------------------------------------------------------
class CustomCollator:
    def __init__(self, processor=None, tokenizer=None, max_length: int = 2048, add_suffix: bool = FIXED):
        # before the fix add_suffix defaulted to False (and a suffix would have been "\n" * 10); after, True
        self.processor = processor
        self.tokenizer = tokenizer
        self.image_token_id = None
        self.max_length = max_length
        self.suffix = ""
        if add_suffix and not FIXED:
            self.suffix = "\n" * 10

        if tokenizer is None and processor is None:
            raise ValueError("Either processor or tokenizer should be provided.")

        if self.processor is not None:
            if self.processor.__class__.__name__ != "SiglipProcessor":
                self.image_token_id = self.processor.tokenizer.convert_tokens_to_ids("<image>")

            if self.tokenizer is not None:
                raise ValueError("Only one of processor or tokenizer should be provided.")

        if self.tokenizer and self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

        if FIXED:
            if self.processor.__class__.__name__ == "PaliGemmaProcessor":
                if self.processor.tokenizer.padding_side != "right":
                    print("Setting padding side to right")
                    self.processor.tokenizer.padding_side = "right"

            if add_suffix:
                if self.tokenizer:
                    self.suffix = self.tokenizer.pad_token * 10
                else:
                    self.suffix = self.processor.tokenizer.pad_token * 10

    def __call__(self, examples):
        if self.processor.__class__.__name__ == "PaliGemmaProcessor":
            return self.forward_vision_pali(examples)
        raise ValueError("Processor not supported")

    def forward_vision_pali(self, examples):
        texts_doc = []
        texts_query = []
        images = []
        for example in examples:

            if example["image"] is None:
                raise ValueError("Image is None - This collator does not support None images yet.")

            image = example["image"].convert("RGB")
            images.append(image)
            texts_doc.append("Describe the image.")

            if example["query"] is None:
                texts_query.append(None)
            else:
                query = example["query"]
                if FIXED:
                    query = f"Question: {query}"
                    # add pad tokens
                    query += self.suffix
                else:
                    query = f"Question: {query}<unused0><unused0><unused0><unused0><unused0>"
                texts_query.append(query)

        batch_doc = self.processor(
            text=texts_doc,
            images=images,
            return_tensors="pt",
            padding="longest",
            max_length=self.max_length + self.processor.image_seq_length,
        )

        batch_query = None
        # check if some but not all queries are None
        if all([t is None for t in texts_query]):
            print("All queries are None. Returning None for all queries.")
        elif any([t is None for t in texts_query]):
            raise ValueError("Some queries are None. This collator does not support None queries yet.")
        else:
            batch_query = self.processor(
                images=images,  # NOTE: the image is not used in batch_query but it is required for calling the processor
                text=texts_query,
                return_tensors="pt",
                padding="longest",
                max_length=self.max_length + self.processor.image_seq_length,
            )
            del batch_query["pixel_values"]
            batch_query["input_ids"] = batch_query["input_ids"][..., self.processor.image_seq_length :]
            batch_query["attention_mask"] = batch_query["attention_mask"][..., self.processor.image_seq_length :]

        # prefix each key with "doc_" or "query_" to avoid key conflicts
        batch_doc = {f"doc_{k}": v for k, v in batch_doc.items()}

        if batch_query is not None:
            batch_query = {f"query_{k}": v for k, v in batch_query.items()}
            batch_doc.update(batch_query)

        return batch_doc


# ---- colpali_engine/models/paligemma_colbert_architecture.py ------------------------------------------
class ColPali(PaliGemmaPreTrainedModel):
    def __init__(self, config):
        super(ColPali, self).__init__(config=config)
        self.model: PaliGemmaForConditionalGeneration = PaliGemmaForConditionalGeneration(config)
        self.dim = 128
        self.custom_text_proj = nn.Linear(self.model.config.text_config.hidden_size, self.dim)
        self.main_input_name = "doc_input_ids"

    def forward(self, *args, **kwargs):
        """
        Forward pass through Llama and the linear layer for dimensionality reduction

        Args:
        - input_ids (torch.LongTensor): The input tokens tensor.
        - attention_mask (torch.LongTensor): The attention mask tensor.

        Returns:
        - torch.Tensor: Embeddings of shape (batch_size, num_tokens, dim)
        """
        outputs = self.model(*args, output_hidden_states=True, **kwargs)
        last_hidden_states = outputs.hidden_states[-1]  # (batch_size, sequence_length, hidden_size)
        proj = self.custom_text_proj(last_hidden_states)
        # normalize l2 norm
        proj = proj / proj.norm(dim=-1, keepdim=True)
        proj = proj * kwargs["attention_mask"].unsqueeze(-1)
        return proj


# ---- colpali_engine/loss/colbert_loss.py ------------------------------------------------------------
class ColbertPairwiseCELoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ce_loss = CrossEntropyLoss()

    def forward(self, query_embeddings, doc_embeddings):
        """
        query_embeddings: (batch_size, num_query_tokens, dim)
        doc_embeddings: (batch_size, num_doc_tokens, dim)

        Positive scores are the diagonal of the scores matrix.
        """

        # Compute the ColBERT scores
        scores = (
            torch.einsum("bnd,csd->bcns", query_embeddings, doc_embeddings).max(dim=3)[0].sum(dim=2)
        )  # (batch_size, batch_size)

        # Positive scores are the diagonal of the scores matrix.
        pos_scores = scores.diagonal()  # (batch_size,)

        # Negative score for a given query is the maximum of the scores against all all other pages.
        neg_scores = scores - torch.eye(scores.shape[0], device=scores.device) * 1e6  # (batch_size, batch_size)
        neg_scores = neg_scores.max(dim=1)[0]  # (batch_size,)

        loss = F.softplus(neg_scores - pos_scores).mean()

        return loss, scores


# ---- colpali_engine/trainer/contrastive_trainer.py (compute_loss) ---------------------------------------
class ContrastiveTrainer:
    def __init__(self, model, loss_func, is_vision_model):
        self.model = model
        self.loss_func = loss_func
        self.is_vision_model = is_vision_model

    def compute_loss(self, model, inputs, return_outputs=False):
        query_outputs = model(input_ids=inputs["query_input_ids"], attention_mask=inputs["query_attention_mask"])
        if self.is_vision_model:
            doc_outputs = model(
                input_ids=inputs["doc_input_ids"],
                attention_mask=inputs["doc_attention_mask"],
                pixel_values=inputs["doc_pixel_values"],
            )
        else:
            doc_outputs = model(input_ids=inputs["doc_input_ids"], attention_mask=inputs["doc_attention_mask"])

        loss = self.loss_func(query_outputs, doc_outputs)
        return (loss, (query_outputs, doc_outputs)) if return_outputs else loss


def main():
    image_size, patch_size = 28, 14
    image_seq_length = (image_size // patch_size) ** 2
    tokenizer = build_paligemma_tokenizer()
    processor = PaliGemmaProcessor(SiglipImageProcessorStub(image_size), tokenizer, image_seq_length)

    vision_config = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=image_size, patch_size=patch_size, projection_dim=32,
    )
    text_config = GemmaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=tokenizer.pad_token_id,
    )
    config = PaliGemmaConfig(
        vision_config=vision_config.to_dict(),
        text_config=text_config.to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        projection_dim=32,
        hidden_size=32,
    )
    model = ColPali(config).eval()

    rng = np.random.RandomState(0)
    queries = [
        "what is the total revenue in 2019?",
        "who signed the letter?",
        "which table shows the yearly rainfall for the northern region?",
        "how many employees are listed on page three?",
    ]
    examples = [
        {"image": Image.fromarray(rng.randint(0, 255, (40, 40, 3), dtype=np.uint8)), "query": q} for q in queries
    ]

    collator = CustomCollator(processor=processor, max_length=50)
    inputs = collator(examples)
    print("query_input_ids:\n", inputs["query_input_ids"])
    print("query_attention_mask:\n", inputs["query_attention_mask"])

    trainer = ContrastiveTrainer(model, ColbertPairwiseCELoss(), is_vision_model=True)
    with torch.no_grad():
        (loss, scores), (query_outputs, doc_outputs) = trainer.compute_loss(model, inputs, return_outputs=True)
    print("query embeddings:", tuple(query_outputs.shape), "doc embeddings:", tuple(doc_outputs.shape))
    print("colbert scores:\n", scores)
    print("loss:", loss.item())


if __name__ == "__main__":
    main()
