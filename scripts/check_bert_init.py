#!/usr/bin/env python3
"""Checks `model.init_from` on the sentence-pair encoder against Hugging Face's own BERT and RoBERTa.

    python3 scripts/check_bert_init.py --kiln target/release/kiln [--family roberta] [--labels mnli|generic]
        [--folder FOLDER [--init-labels a,b,c]] [--scratch [--segments 1]]

Needs `torch` and `transformers` (pip install torch transformers). Without
--folder it makes a small random `BertForSequenceClassification` (2 layers,
64 wide, BERT's pooler and ε, its WordPiece tokenizer trained on the pairs;
with --family roberta a `RobertaForSequenceClassification` with a
byte-level BPE, with --family electra an `ElectraForSequenceClassification`
as ELECTRA base is laid out, with --family distilbert a
`DistilBertForSequenceClassification`) whose classifier is trained for the run's labels, so that
kiln loads it too: named as the run names them (--labels run), in another
order and in capitals as `roberta-large-mnli` names them (--labels mnli:
kiln reorders the outputs), or `LABEL_0`, `LABEL_1`, `LABEL_2` meaning
contradiction, entailment, neutral (--labels generic: kiln is told so by
`model.init_labels`). --folder takes a real one instead, whose
config.json's id2label must name entailment, neutral and contradiction in
any order and letter case (a model fine-tuned on MultiNLI), or whose
outputs --init-labels names (passed to kiln as model.init_labels): for a
base model such as bert-base-uncased kiln's new classifier and
transformers' are drawn apart, so their probabilities cannot be compared
(the export's still are).

It then runs, in a temporary folder:

    kiln cv model.init_from=FOLDER <the folder's shape> training.learning_rate=1e-12 ...
    kiln predict RUN --data PAIRS
    kiln predict FOLDER --data PAIRS

(one optimizer step at a learning rate of 1e-12, which moves no weight by
more than about 1e-12) and compares kiln's class probabilities for every
pair, from the run and from the folder itself, with `transformers`' for the same pairs, tokenized by the folder's
tokenizer as kiln does (`[CLS] a [SEP] b [SEP]`, cut longest-first to
max_length). Then `kiln export RUN` writes the run's best fold as a
`BertForSequenceClassification` (a RoBERTa-, ELECTRA- or DistilBERT-started
run as that family's class), and `transformers` loads it and its
tokenizer from that folder alone: its probabilities against kiln's too.
With --scratch there is no BERT folder: a 2 × 64 encoder trains 30
steps from random weights with kiln's own WordPiece, and only its export
is compared. Prints the largest differences; exits 1 above --tolerance.
Not run by the tests or CI (which have no torch); see docs/NLI.md,
"Fine-tuning a pretrained encoder".
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LABELS = ["entailment", "neutral", "contradiction"]

# What the random folder's classifier outputs mean, in its order, and the
# names its id2label gives them (--labels).
LABELINGS = {
    "run": (LABELS, LABELS),
    "mnli": (
        ["contradiction", "neutral", "entailment"],
        ["CONTRADICTION", "NEUTRAL", "ENTAILMENT"],
    ),
    "generic": (
        ["contradiction", "entailment", "neutral"],
        ["LABEL_0", "LABEL_1", "LABEL_2"],
    ),
}


def make_bert(folder: Path, pairs: list, max_length: int, family: str, names: list, embedding: int) -> None:
    import torch
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        DistilBertTokenizerFast,
        ElectraConfig,
        ElectraForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
        RobertaTokenizerFast,
    )

    texts = [p["premise"] for p in pairs] + [p["hypothesis"] for p in pairs]
    shape = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        id2label=dict(enumerate(names)),
        label2id={l: i for i, l in enumerate(names)},
    )
    if family in ("bert", "electra", "distilbert"):
        wordpiece = BertWordPieceTokenizer(lowercase=True)
        wordpiece.train_from_iterator(texts, vocab_size=2000, min_frequency=1)
        tokenizer = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer)
        if family == "distilbert":
            # DistilBERT's names for the shape; no segment ids.
            tokenizer = DistilBertTokenizerFast(tokenizer_object=wordpiece._tokenizer)
            config = DistilBertConfig(
                vocab_size=wordpiece.get_vocab_size(),
                dim=shape["hidden_size"],
                n_layers=shape["num_hidden_layers"],
                n_heads=shape["num_attention_heads"],
                hidden_dim=shape["intermediate_size"],
                max_position_embeddings=max_length + 16,
                id2label=shape["id2label"],
                label2id=shape["label2id"],
            )
            new = DistilBertForSequenceClassification
        elif family == "bert":
            config = BertConfig(
                vocab_size=wordpiece.get_vocab_size(),
                max_position_embeddings=max_length + 16,
                **shape,
            )
            new = BertForSequenceClassification
        else:
            # ELECTRA base's layout: embeddings as wide as the model (or,
            # --embedding-size, ELECTRA-small's: narrower, projected), a
            # classification head with the GELU.
            config = ElectraConfig(
                vocab_size=wordpiece.get_vocab_size(),
                embedding_size=embedding or shape["hidden_size"],
                max_position_embeddings=max_length + 16,
                **shape,
            )
            new = ElectraForSequenceClassification
    else:
        # RoBERTa's byte-level BPE and specials (<s>=0, <pad>=1, </s>=2), its
        # positions after the padding id, one segment.
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            texts,
            vocab_size=2000,
            min_frequency=1,
            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        )
        tokenizer = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer)
        config = RobertaConfig(
            vocab_size=bpe.get_vocab_size(),
            max_position_embeddings=max_length + 2 + 16,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **shape,
        )
        new = RobertaForSequenceClassification
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = new(config)
    # Random weights at BERT's scale make a near-uniform classifier; a wider
    # spread makes the probabilities differ from pair to pair.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kiln", type=Path, required=True)
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--data", type=Path, default=Path("data/snli_sample.jsonl"))
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument(
        "--family",
        choices=["bert", "roberta", "electra", "distilbert"],
        default="bert",
        help="the random folder's architecture (without --folder)",
    )
    parser.add_argument(
        "--embedding-size",
        type=int,
        default=0,
        help="with --family electra: embeddings this wide, projected to the model's (ELECTRA-small's layout)",
    )
    parser.add_argument(
        "--labels",
        choices=sorted(LABELINGS),
        default="run",
        help="how the random folder's id2label names its classifier outputs (without --folder)",
    )
    parser.add_argument(
        "--init-labels",
        help="with --folder: what its classifier outputs mean, in order, comma-separated "
        "(model.init_labels), where its id2label says LABEL_0, ...",
    )
    parser.add_argument(
        "--scratch",
        action="store_true",
        help="no BERT folder: a small encoder trained from random weights with kiln's own "
        "WordPiece for 30 steps, then only its export is compared",
    )
    parser.add_argument(
        "--segments",
        type=int,
        choices=[1, 2],
        default=2,
        help="with --scratch: the encoder's segment rows (model.segments); 1 exports it as a "
        "RobertaForSequenceClassification",
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    lines = args.data.read_text().splitlines()[: args.pairs]
    pairs = [json.loads(l) for l in lines]
    work = Path(tempfile.mkdtemp(prefix="kiln-bert-"))
    data = work / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    folder = args.folder
    # What the folder's classifier outputs mean, in its order; and what kiln
    # is told of them (model.init_labels), where its id2label does not say.
    meaning, init_labels = None, []
    if folder is None and not args.scratch:
        folder = work / "bert"
        meaning, names = LABELINGS[args.labels]
        make_bert(folder, pairs, args.max_length, args.family, names, args.embedding_size)
        if args.labels == "generic":
            init_labels = meaning
    elif args.init_labels:
        init_labels = meaning = args.init_labels.split(",")
    if args.scratch:
        bert = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                "intermediate_size": 128, "layer_norm_eps": 1e-5, "type_vocab_size": args.segments}
    else:
        bert = json.loads((folder / "config.json").read_text())
        if bert.get("model_type") == "distilbert":
            # BERT's names for DistilBertConfig's keys; its ε is always 1e-12.
            bert.update(num_hidden_layers=bert["n_layers"], num_attention_heads=bert["n_heads"],
                        hidden_size=bert["dim"], intermediate_size=bert["hidden_dim"],
                        layer_norm_eps=1e-12, type_vocab_size=0)
        if meaning is None:
            meaning = [bert["id2label"][str(i)].lower() for i in range(len(bert["id2label"]))]
    pooler = {"electra": "gelu", "distilbert": "relu"}.get(bert.get("model_type"), "tanh")

    overrides = [
        "experiment=nli_snli",
        f"data.path={data}",
        f"model.init_from={folder or 'none'}",
        f"model.layers={bert['num_hidden_layers']}",
        f"model.heads={bert['num_attention_heads']}",
        f"model.hidden={bert['hidden_size']}",
        f"model.intermediate={bert['intermediate_size']}",
        f"model.max_length={args.max_length}",
        f"model.layer_norm_eps={bert.get('layer_norm_eps', 1e-12 if bert.get('model_type') == 'bert' else 1e-5)}",
        "model.pooling=pooler",
        f"model.pooler_activation={pooler}",
        f"model.segments={bert.get('type_vocab_size', 2)}",
        f"model.embedding_size={bert.get('embedding_size', 0) if bert.get('embedding_size') != bert['hidden_size'] else 0}",
        f"model.init_labels={json.dumps(init_labels)}",
        "model.dropout=0.0",
        "cv.folds=2",
        "training.epochs=0",
        "training.warmup_steps=0",
        "training.weight_decay=0.0",
        *(
            ["training.max_steps=30", "training.learning_rate=1e-3", "training.min_lr=1e-4"]
            if args.scratch
            else ["training.max_steps=1", "training.learning_rate=1e-12", "training.min_lr=1e-12"]
        ),
        f"run.dir={work}/run",
    ]
    subprocess.run([str(args.kiln), "cv", *overrides], check=True)
    subprocess.run(
        [str(args.kiln), "predict", f"{work}/run", "--data", str(data), "--out", str(work / "p.jsonl")],
        check=True,
    )
    kiln = [json.loads(l) for l in (work / "p.jsonl").read_text().splitlines()]
    # kiln predict on the folder itself, with no run.
    direct = None
    if folder:
        subprocess.run(
            [str(args.kiln), "predict", str(folder), "--data", str(data), "--out", str(work / "direct.jsonl"),
             f"model.max_length={args.max_length}", f"model.init_labels={json.dumps(init_labels)}"],
            check=True,
        )
        direct = [json.loads(l) for l in (work / "direct.jsonl").read_text().splitlines()]

    def compare(folder: Path, meaning: list, kiln: list = kiln) -> tuple:
        """transformers on `folder`, whose outputs mean `meaning`, against
        kiln's probabilities: the largest difference, and how many
        predictions are the same."""
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        worst, agree = 0.0, 0
        with torch.no_grad():
            for pair, ours in zip(pairs, kiln):
                enc = tokenizer(
                    pair["premise"],
                    pair["hypothesis"],
                    truncation="longest_first",
                    max_length=args.max_length,
                    return_tensors="pt",
                )
                probs = torch.softmax(model(**enc).logits[0], dim=-1).tolist()
                theirs = dict(zip(meaning, probs))
                mine = ours["probabilities"]
                for label in LABELS:
                    worst = max(worst, abs(mine[label] - theirs[label]))
                agree += max(mine, key=mine.get) == max(theirs, key=theirs.get)
        return worst, agree

    # The folder the run started from, where there is one.
    worst, agree = compare(folder, meaning) if folder else (0.0, 0)
    direct_worst, direct_agree = compare(folder, meaning, direct) if folder else (0.0, 0)
    # The run's best fold exported (as a BertForSequenceClassification, or
    # the family's own where kiln writes it: RoBERTa, ELECTRA, DistilBERT).
    subprocess.run([str(args.kiln), "export", f"{work}/run", "--out", str(work / "hf")], check=True)
    export_worst, export_agree = compare(work / "hf", LABELS)
    exported_class = json.loads((work / "hf" / "config.json").read_text())["architectures"][0]
    print(
        json.dumps(
            {
                "pairs": len(kiln),
                "largest_probability_difference": worst,
                "predict_folder_largest_probability_difference": direct_worst,
                "exported_largest_probability_difference": export_worst,
                "same_prediction": agree,
                "predict_folder_same_prediction": direct_agree,
                "exported_same_prediction": export_agree,
                "exported_as": exported_class,
                "folder": str(folder) if folder else "(trained from scratch)",
                "folder_outputs": meaning,
                "torch": torch.__version__,
            }
        )
    )
    return 0 if max(worst, direct_worst, export_worst) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
