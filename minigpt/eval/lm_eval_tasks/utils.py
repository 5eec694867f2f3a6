"""Document functions for the lm-eval task YAMLs beside this file (loaded by lm-eval's ``!function`` tag, not by
MiniGPT): the same facts as lm-eval's own ``hellaswag/utils.py`` and ``winogrande/preprocess_winogrande.py``, for
the field layout of the local JSONL copies (shared/data/README.md)."""


def _capitalise_unfinished_sentence(ctx):
    # lm-eval builds the query from ctx_a + " " + ctx_b.capitalize(); the local copy only has ctx (ctx_b lower-case),
    # and ctx_b is the unfinished sentence after the last sentence end.
    start = max(ctx.rfind(end) for end in (". ", "! ", "? "))
    start = 0 if start < 0 else start + 2
    if ctx[start:start + 1].islower():
        ctx = ctx[:start] + ctx[start].upper() + ctx[start + 1:]
    return ctx


def process_hellaswag(dataset):
    def _process(doc):
        return {"query": doc["activity_label"] + ": " + _capitalise_unfinished_sentence(doc["ctx"]),
                "choices": list(doc["endings"]), "gold": int(doc["label"])}

    return dataset.map(_process)


def winogrande_doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc):
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def winogrande_doc_to_choice(doc):
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
