"""model.init_from's tokenizer against the data's: a model reads token ids as the tokens of the tokenizer it was
trained with, so data tokenized by another one trains it on nonsense without any error. Refused at start-up, each
message naming which tokenizer came from where and what to change.

Two tokenizers are the same when their token -> id maps are: a tokenizer.json that differs only in its normalizer,
pre-tokenizer or post-processor gives the model the same ids for the same tokens (its file hash differs).
"""

import os
from pathlib import Path

from data.token_files import TRAIN_FILE, TokenFiles, meta_path_of, read_token_files
from data.tokenizer_file import file_digest, read_tokenizer_file

PREPARE = "python prepare_data.py input=CORPUS out=NEW_DIR tokenizer={model}"


def same_vocabulary(a: str, b: str) -> bool:
    """Whether two tokenizer.json files map the same tokens to the same ids (the same bytes: without reading them)."""
    if file_digest(a) == file_digest(b):
        return True
    return read_tokenizer_file(a).get_vocab(with_added_tokens=True) == read_tokenizer_file(b).get_vocab(
        with_added_tokens=True
    )


def prepared_files(path: str | None) -> TokenFiles | None:
    """The metadata of data.path when it is (a token file of) a folder prepare_data.py wrote; None for a bare .bin
    or a path that does not exist (start-up's data checks name those)."""
    if not path or not os.path.exists(path):
        return None
    if os.path.isdir(path):
        if not os.path.exists(meta_path_of(path)):
            return None
        path = os.path.join(path, TRAIN_FILE)
    meta = read_token_files(path)
    return meta if meta.meta_path is not None else None


def check_prepared_data(prepared: TokenFiles, data_path: str, model_dir: Path, own: Path | None, vocab: int) -> None:
    """data=memmap on a prepared folder with model.init_from: the folder's tokenizer (its stagecheck_data.json) must
    fit the model's embedding (config.json vocab_size) and, where the model directory holds a tokenizer.json, be that
    tokenizer. ValueError naming both and the prepare_data.py command that tokenizes the corpus for the model."""
    where = f"data.path={data_path!r} was prepared ({prepared.meta_path})"
    fix = (
        f"prepare the corpus again with the model's tokenizer: `{PREPARE.format(model=model_dir)}`, then "
        f"data.path=NEW_DIR"
    )
    if prepared.vocab_size is not None and prepared.vocab_size > vocab:
        raise ValueError(
            f"{where} with a tokenizer of {prepared.vocab_size:,} token ids, and "
            f"model.init_from={model_dir} embeds {vocab:,} (its config.json vocab_size): ids past {vocab - 1} have "
            f"no embedding; {fix}"
        )
    if own is None:
        return
    if prepared.tokenizer_file is None:
        raise ValueError(
            f"{where} with the {prepared.tokenizer_kind} tokenizer, and model.init_from={model_dir} reads ids as the "
            f"tokens of its own {own.name}: {fix}"
        )
    if not same_vocabulary(prepared.tokenizer_file, str(own)):
        raise ValueError(
            f"{where} with the tokenizer saved there ({prepared.tokenizer_file}), which maps tokens to other ids than "
            f"model.init_from={model_dir}'s {own.name}: the model would read the data's ids as other tokens; {fix}"
        )


def check_chosen_tokenizer(tokenizer_file: str, model_dir: Path, own: Path) -> None:
    """An explicit data.tokenizer_file beside a model.init_from that has its own tokenizer.json: refused when the two
    map tokens to other ids (the model's embeddings would be read as other tokens: training would silently start from
    a scrambled model; stagecheck does not resize or re-map embeddings)."""
    if not same_vocabulary(tokenizer_file, str(own)):
        raise ValueError(
            f"data.tokenizer_file={tokenizer_file!r} maps tokens to other ids than model.init_from={model_dir}'s "
            f"{own.name}, which the model's embeddings were trained with: drop data.tokenizer_file (the model's own "
            f"is used), or start without model.init_from"
        )
