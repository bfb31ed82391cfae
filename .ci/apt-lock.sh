# Sourced by .ci/setup and tests/guest/setup: `apt_get ARGS...` is apt-get that
# waits for the dpkg/apt locks another install on this host holds, up to
# APT_LOCK_WAIT_S (600 s), instead of failing with exit 100 at once.
#
# apt-get install waits by itself with `-o DPkg::Lock::Timeout=N` (the dpkg
# frontend lock); apt-get update does not (apt 2.6: /var/lib/apt/lists/lock
# fails at once whatever that timeout says), so a run that failed on a lock is
# run again every 2 s until the deadline. Any other failure is returned as is.
apt_get() {
	local wait_s=${APT_LOCK_WAIT_S:-600}
	local deadline=$((SECONDS + wait_s)) out rc
	while true; do
		rc=0
		out=$(apt-get -o "DPkg::Lock::Timeout=$wait_s" "$@" 2>&1) || rc=$?
		if [ "$rc" -eq 0 ]; then
			[ -z "$out" ] || printf '%s\n' "$out"
			return 0
		fi
		if grep -q 'Could not get lock' <<<"$out" && [ "$SECONDS" -lt "$deadline" ]; then
			echo "apt_get: $(grep -m1 'Could not get lock' <<<"$out" | sed 's/^E: //'); waiting" >&2
			sleep 2
			continue
		fi
		printf '%s\n' "$out" >&2
		return "$rc"
	done
}
