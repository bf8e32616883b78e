# apt_install PACKAGE…: Debian packages for the checks, as root or through passwordless sudo;
# refreshes the package lists once if the first try fails. The caller defines `say` and `die`.
apt_install() {
    local run=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null && sudo -n true 2>/dev/null ||
            die "$* missing and no root to install it: apt-get install $*"
        run=(sudo -n)
    fi
    say "installing $* with apt-get"
    "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >/dev/null || {
        "${run[@]}" apt-get update -qq >/dev/null
        "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
            >/dev/null
    } || die "apt-get install $* failed"
}
