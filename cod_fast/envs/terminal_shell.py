"""The simulated shell of the terminal environment (cod_fast.envs.terminal): an in-memory file
tree and the commands, outputs and error messages of each dialect (Windows cmd, macOS zsh, Linux
bash).

It is pure Python over nested dicts: nothing here touches the real file system or starts a
process, and a command line is only split into words, never executed. Only what lies inside the
user's home folder may change.
"""

from __future__ import annotations

import re
import shlex

DIALECTS = ("windows", "macos", "linux")


def tokenize(line: str) -> list[str] | None:
    """Split a command line into words (quotes group words); None when the quoting is broken.
    Backslashes stay literal, since they are Windows path separators."""
    try:
        return shlex.split(line, posix=False)
    except ValueError:
        return None


def dialect_of(output: str) -> str | None:
    """The dialect a shell output gives away, if any."""
    if "is not recognized" in output or "Microsoft Windows" in output:
        return "windows"
    if "zsh:" in output or output.strip() == "Darwin":
        return "macos"
    if "bash:" in output or output.strip() == "Linux":
        return "linux"
    return None


class Shell:
    """An in-memory file tree (folders are dicts, files are strings) and one dialect's commands."""

    def __init__(self, dialect: str, user: str, home: dict, short: bool):
        self.dialect, self.short = dialect, short
        top = {"windows": ["C:", "Users"], "macos": ["Users"]}.get(dialect, ["home"])
        self.home = [*top, user]
        self.root: dict = {}
        node = self.root
        for part in self.home[:-1]:
            node = node.setdefault(part, {})
        node[self.home[-1]] = home
        self.cwd = list(self.home)
        self.opened: set[tuple[str, ...]] = set()

    def show(self, path: list[str]) -> str:
        if self.dialect == "windows":
            return "\\".join(path) if len(path) > 1 else path[0] + "\\"
        return "/" + "/".join(path)

    def resolve(self, arg: str) -> list[str] | None:
        """Absolute path components of `arg`; None for a Windows path written with `/`."""
        arg = arg.strip('"')
        if self.dialect == "windows":
            if "/" in arg:
                return None
            drive = re.match(r"^[a-zA-Z]:", arg)
            parts = ["C:"] if drive else list(self.cwd[:1] if arg.startswith("\\") else self.cwd)
            rest = arg[2:] if drive else arg
            pieces = rest.split("\\")
        else:
            parts = [] if arg.startswith("/") else list(self.cwd)
            if arg == "~" or arg.startswith("~/"):
                parts, arg = list(self.home), arg[1:]
            pieces = arg.split("/")
        for piece in pieces:
            if piece == "..":
                parts = parts[:-1] if len(parts) > (self.dialect == "windows") else parts
            elif piece not in ("", "."):
                parts.append(piece)
        return parts

    def writable(self, path: list[str]) -> bool:
        """Only what lies inside home may change (the rest of the tree is the system's)."""
        return len(path) > len(self.home) and path[: len(self.home)] == self.home

    def get(self, path: list[str]):
        node = self.root
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def run(self, words: list[str]) -> str:
        name, args = words[0], words[1:]
        if self.dialect == "windows":
            return self._windows(name.lower(), [a for a in args if not a.startswith("/")])
        return self._unix(name, args)

    def _not_found(self, name: str) -> str:
        if self.dialect == "windows":
            tail = " as an internal or external command,\noperable program or batch file."
            return f"'{name}' is not recognized{'' if self.short else tail}"
        if self.dialect == "macos":
            return f"zsh: command not found: {name}"
        return f"bash: {name}: command not found"

    def _transfer(self, args: list[str], keep: bool) -> str | None:
        """copy/move `args[0]` to `args[1]` (into it when it is a folder); None when done, else
        the kind of failure: `usage`, `syntax`, `missing`, `path`, `denied` or `same`."""
        if len(args) != 2:
            return "usage"
        src, dst = self.resolve(args[0]), self.resolve(args[1])
        if src is None or dst is None:
            return "syntax"
        content = self.get(src)
        if not isinstance(content, str):
            return "missing"
        if isinstance(self.get(dst), dict):
            dst = [*dst, src[-1]]
        elif args[1].endswith(("/", "\\")):
            return "path"
        if not self.writable(dst) or not (keep or self.writable(src)):
            return "denied"
        folder = self.get(dst[:-1])
        if not isinstance(folder, dict) or isinstance(folder.get(dst[-1]), dict):
            return "path"
        if dst == src:
            return "same"
        folder[dst[-1]] = content
        if not keep:
            del self.get(src[:-1])[src[-1]]
        return None

    def _windows(self, name: str, args: list[str]) -> str:
        syntax = "The syntax of the command is incorrect."
        no_file = "The system cannot find the file specified."
        no_path = "The system cannot find the path specified."
        denied = "Access is denied."
        if name in ("copy", "move"):
            error = self._transfer(args, keep=name == "copy")
            if error is None:
                done = f"1 file(s) {'copied' if name == 'copy' else 'moved'}."
                return done if self.short else f"        {done}"
            if error == "same":
                return "The file cannot be copied onto itself."
            return {"missing": no_file, "path": no_path, "denied": denied}.get(error, syntax)
        if name == "ver":
            return "Microsoft Windows [Version 10.0.19045.3803]"
        if name not in ("dir", "type", "del", "erase", "mkdir", "md", "cd", "chdir", "start"):
            return self._not_found(name)
        if len(args) > 1 or (not args and name not in ("dir", "cd", "chdir")):
            return syntax
        path = self.resolve(args[0]) if args else list(self.cwd)
        if path is None:
            return syntax
        node = self.get(path)
        if name == "dir":
            if not isinstance(node, dict):
                return "File Not Found"
            entries = [
                ("<DIR>  " if isinstance(node[k], dict) else " " * 7) + k for k in sorted(node)
            ]
            if self.short:
                return " ".join(" ".join(e.split()) for e in entries)
            return "\n".join([f" Directory of {self.show(path)}", "", *entries])
        if name in ("cd", "chdir"):
            if not args:
                return self.show(self.cwd)
            if not isinstance(node, dict):
                return no_path
            self.cwd = path
            return ""
        if name in ("mkdir", "md", "del", "erase") and not self.writable(path):
            return denied
        if name in ("mkdir", "md"):
            if node is not None:
                return f"A subdirectory or file {args[0]} already exists."
            return no_path if self._mkdir(path, parents=True) else ""
        if not isinstance(node, str):
            if name in ("del", "erase"):
                return f"Could Not Find {self.show(path)}"
            return no_file if name == "type" else f"The system cannot find the file {args[0]}."
        if name == "type":
            return node
        if name == "start":
            self.opened.add(tuple(path))
            return ""
        del self.get(path[:-1])[path[-1]]
        return ""

    def _mkdir(self, path: list[str], parents: bool) -> str | None:
        """Make folder `path`; with `parents` also the missing folders above it."""
        node = self.root
        for i, part in enumerate(path):
            if part not in node:
                if i < len(path) - 1 and not parents:
                    return "missing"
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                return "missing"
        return None

    def _unix(self, name: str, args: list[str]) -> str:
        mac = self.dialect == "macos"
        flags = [a for a in args if a.startswith("-")]
        args = [a for a in args if not a.startswith("-")]

        def fail(cmd: str, arg: str, why: str, verb: str = "cannot stat") -> str:
            # BSD tools (macOS) and GNU tools (Linux) word their errors differently.
            return f"{cmd}: {arg}: {why}" if mac else f"{cmd}: {verb} '{arg}': {why}"

        missing = "No such file or directory"
        if name == "uname":
            return "Darwin" if mac else "Linux"
        if name == "pwd":
            return self.show(self.cwd)
        if name in ("cp", "mv"):
            error = self._transfer(args, keep=name == "cp")
            if error is None:
                return ""
            if error == "usage":
                return f"usage: {name} source target" if mac else f"{name}: missing file operand"
            if error == "same":
                return f"{name}: {args[0]} and {args[1]} are identical"
            if error == "denied":
                return fail(name, args[1], "Permission denied", "cannot create regular file")
            return fail(name, args[error == "path"], missing)
        if name not in ("ls", "cat", "rm", "mkdir", "cd", "open" if mac else "xdg-open"):
            return self._not_found(name)
        if name == "ls":
            if mac and "--color" in flags:  # BSD ls spells it -G
                return "ls: unrecognized option `--color'"
            node = self.get(self.resolve(args[0]) if args else self.cwd)
            if node is None:  # with no argument: the working folder was removed (`rm -r .`)
                return fail("ls", args[0] if args else ".", missing, "cannot access")
            if isinstance(node, str):
                return args[0]
            mark = any("F" in f for f in flags)
            return "  ".join(k + "/" * (mark and isinstance(node[k], dict)) for k in sorted(node))
        if name == "cd":
            path = self.resolve(args[0]) if args else list(self.home)
            if not isinstance(self.get(path), dict):
                return (
                    f"cd: no such file or directory: {args[0]}"
                    if mac
                    else f"bash: cd: {args[0]}: {missing}"
                )
            self.cwd = path
            return ""
        if len(args) != 1:
            return f"usage: {name} file" if mac else f"{name}: missing operand"
        path = self.resolve(args[0])
        node = self.get(path)
        if name in ("mkdir", "rm") and not self.writable(path):
            verb = "cannot remove" if name == "rm" else "cannot create directory"
            return fail(name, args[0], "Permission denied", verb)
        if name == "mkdir":
            if node is not None:
                return fail("mkdir", args[0], "File exists", "cannot create directory")
            if self._mkdir(path, parents="-p" in flags):
                return fail("mkdir", args[0], missing, "cannot create directory")
            return ""
        if name == "rm" and isinstance(node, dict) and any("r" in f for f in flags):
            del self.get(path[:-1])[path[-1]]
            return ""
        if name == "rm" and isinstance(node, dict):
            return fail(
                "rm", args[0], "is a directory" if mac else "Is a directory", "cannot remove"
            )
        if not isinstance(node, str):
            if name == "open":
                return f"The file {self.show(path)} does not exist."
            if name == "xdg-open":
                return f"xdg-open: file '{args[0]}' does not exist"
            if name == "cat":  # GNU cat words it like BSD cat
                return f"cat: {args[0]}: {missing}"
            return fail(name, args[0], missing, "cannot remove" if name == "rm" else "cannot stat")
        if name == "cat":
            return node
        if name == "rm":
            del self.get(path[:-1])[path[-1]]
            return ""
        self.opened.add(tuple(path))
        return ""
