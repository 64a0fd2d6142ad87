"""A griffe extension for the API reference: a function whose decorator gives it another
signature (sets `__signature__`, as `rlhf_eqx.train.step_builder` does) is documented
with the signature it has when called, not the one written under the decorator.

mkdocstrings reads the sources; this looks the decorated functions up at run time
(`inspect.signature`) and replaces their parameters, the annotations written as the
reference writes every other one: by their names, without module paths
(`GradientTransformation`, `SFTSettings | None`).
"""

import inspect
import re

import griffe

_MODULE_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")


def _annotation(p: inspect.Parameter) -> str | None:
    if p.annotation is inspect.Parameter.empty:
        return None
    return _MODULE_PATH.sub(r"\1", inspect.formatannotation(p.annotation))


class RuntimeSignatures(griffe.Extension):
    def on_function_instance(self, *, node, func: griffe.Function, agent, **kwargs) -> None:
        if not func.decorators:
            return
        try:
            obj = griffe.dynamic_import(func.path)
        except ImportError:
            return
        if "__signature__" not in getattr(obj, "__dict__", {}):
            return
        runtime = inspect.signature(obj).parameters.values()
        if [p.name for p in runtime] == [p.name for p in func.parameters]:
            return
        func.parameters = griffe.Parameters(
            *(
                griffe.Parameter(
                    p.name,
                    annotation=_annotation(p),
                    kind=griffe.ParameterKind(p.kind.description),
                    default=None if p.default is inspect.Parameter.empty else repr(p.default),
                )
                for p in runtime
            )
        )
