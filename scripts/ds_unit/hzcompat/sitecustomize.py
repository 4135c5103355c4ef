"""hf_zero-only harness aid (never loaded for real DeepSpeed): lets DeepSpeed's unit-test files *import*
DeepSpeed-internal names that the hf_zero shim does not provide, so the tests' user-facing bodies can run.
- a name missing from an existing shim module, or a missing deepspeed.* module, is answered only if real
  DeepSpeed 0.19.8 defines it (read with ast from $DS_SITE, DeepSpeed's site-packages; never imported);
- literal constants (strings, numbers, tuples...) get DeepSpeed's literal value;
- anything else becomes a placeholder class that raises HZCompatMissing when instantiated/called.
Every answered name is appended to $HZ_COMPAT_LOG."""
import ast, importlib.abc, importlib.machinery, importlib.util, os, sys, types

DS_ROOT = os.environ.get("DS_SITE", "/work/dsvenv/lib/python3.11/site-packages")
LOG = os.environ.get("HZ_COMPAT_LOG",
                     os.path.join(os.environ.get("DSUNIT_ROOT", "/work/dsunit"), "logs", "hz_compat_names.log"))


class HZCompatMissing(RuntimeError):
    pass


def _log(s):
    try:
        with open(LOG, "a") as fh:
            fh.write(s + "\n")
    except OSError:
        pass


def _ds_file(modname):
    base = os.path.join(DS_ROOT, *modname.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(p):
            return p
    return None


_cache = {}


def _ds_names(modname, depth=0):
    """name -> ('lit', value) | ('obj', None) | ('imp', (mod, name))"""
    if modname in _cache:
        return _cache[modname]
    res = {}
    _cache[modname] = res
    p = _ds_file(modname)
    if p is None or depth > 6:
        return res
    try:
        tree = ast.parse(open(p).read())
    except Exception:
        return res
    pkg = modname if p.endswith("__init__.py") else modname.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:  # X: List[str] = [...]
            node = ast.Assign(targets=[node.target], value=node.value)
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    try:
                        res[t.id] = ("lit", ast.literal_eval(node.value))
                    except Exception:
                        res[t.id] = ("obj", None)
                        # constant arithmetic over earlier literal names (e.g. MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES)
                        ok = all(isinstance(n, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
                                                ast.operator, ast.unaryop)) for n in ast.walk(node.value))
                        if ok:
                            env = {}
                            for n in ast.walk(node.value):
                                if isinstance(n, ast.Name):
                                    k, v = _resolve(modname, n.id) if n.id not in res else res[n.id]
                                    if k == "lit":
                                        env[n.id] = v
                            try:
                                res[t.id] = ("lit", eval(compile(ast.Expression(node.value), "<c>", "eval"),
                                                         {"__builtins__": {}}, env))
                            except Exception:
                                pass
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            res[node.name] = ("obj", None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                src = base + ("." + node.module if node.module else "")
            else:
                src = node.module or ""
            for a in node.names:
                if a.name != "*":
                    res[a.asname or a.name] = ("imp", (src, a.name))
    return res


def _resolve(modname, name, depth=0):
    kind, v = _ds_names(modname).get(name, (None, None))
    if kind == "imp" and depth < 6:
        src, n = v
        if src.startswith("deepspeed"):
            r = _resolve(src, n, depth + 1)
            if r[0] is not None:
                return r
            if _ds_file(src + "." + n):
                return ("mod", src + "." + n)
        return ("obj", None)
    return (kind, v)


def _placeholder(modname, name):
    def _raise(*a, **k):
        raise HZCompatMissing(f"{modname}.{name} is DeepSpeed-internal and not provided by the hf_zero shim")

    return type(name, (), {"__new__": lambda cls, *a, **k: _raise(), "__init_subclass__": classmethod(lambda c, **k: None),
                           "__module__": modname, "_hz_compat_placeholder": True,
                           "__class_getitem__": classmethod(lambda c, i: c)})


def _make_getattr(modname, mod=None):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls_ga = getattr(type(mod), "__getattr__", None) if mod is not None else None
        if cls_ga is not None:
            try:
                return cls_ga(mod, name)
            except AttributeError:
                pass
        kind, v = _resolve(modname, name)
        if kind is None:
            raise AttributeError(f"module {modname!r} has no attribute {name!r}")
        if kind == "lit":
            val = v
        elif kind == "mod":
            val = importlib.import_module(v)
        else:
            val = _placeholder(modname, name)
        _log(f"attr {modname}.{name} -> {kind}")
        return val
    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__getattr__ = _make_getattr(module.__name__)
        _log(f"module {module.__name__}")


class _Wrap(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        name = module.__name__
        for m in {id(module): module, id(sys.modules.get(name)): sys.modules.get(name)}.values():
            if m is not None and "__getattr__" not in m.__dict__:
                m.__dict__["__getattr__"] = _make_getattr(name, m)

    def __getattr__(self, n):
        return getattr(self.inner, n)


class _Front(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path, target=None):
        if not (name == "deepspeed" or name.startswith("deepspeed.")) or self.busy:
            return None
        self.busy = True
        try:
            spec = None
            for f in sys.meta_path:
                if f is self or isinstance(f, _Back):
                    continue
                fs = getattr(f, "find_spec", None)
                if fs is None:
                    continue
                spec = fs(name, path, target)
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _StubLoader):
            spec.loader = _Wrap(spec.loader)
        return spec


class _Back(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith("deepspeed.") or _ds_file(name) is None:
            return None
        p = _ds_file(name)
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=p.endswith("__init__.py"))


if os.environ.get("HF_ZERO_DISABLE_DEEPSPEED_SHIM") != "1":
    sys.meta_path.insert(0, _Front())
    sys.meta_path.append(_Back())
