#!/bin/sh
# PID 1 of the test guest (busybox sh, inside the initramfs that setup builds).
# Loads the virtio/9p/overlay modules, mounts the job share (9p tag ps_out) at
# /out, builds the new root: the host's / (9p tag ps_root, read-only) under an
# overlayfs whose upper layer is a tmpfs, so the job may write anywhere and
# the host is never changed. Then the guest's own /proc, /sys, /dev, /run and
# cgroup tree (v2, v1 or hybrid, from /out/vm.conf), runs /out/job.sh with
# the host's bash chrooted there (stdout, stderr and exit code into /out) and
# powers off.
export PATH=/bin
umask 022

log() { echo "guest-init: $*"; }
die() {
	log "FATAL: $*"
	echo "guest-init: FATAL: $*" >>/out/init-error 2>/dev/null
	poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
while read -r m; do
	insmod "/lib/modules/$m" || log "insmod $m failed"
done </modules.load

# msize: 9p's default (8 KiB) makes every read of the host's files a round trip
P9=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$P9,cache=none" ps_out /out || die "cannot mount the job share"
CGROUP=v2
. /out/vm.conf
# cache=loose: the host's files do not change under a test run, and the
# page cache spares most 9p round trips
mount -t 9p -o "$P9,ro,cache=loose" ps_root /host || die "cannot mount the host's root (9p)"
mount -t tmpfs -o mode=755 upper /upper && mkdir /upper/data /upper/work &&
	mount -t overlay overlay -o lowerdir=/host,upperdir=/upper/data,workdir=/upper/work /newroot ||
	die "overlayfs over the host's root failed"

R=/newroot
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t devtmpfs devtmpfs "$R/dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts "$R/dev/pts"
mount -t tmpfs -o mode=1777 shm "$R/dev/shm"
mount -t tmpfs -o mode=755 run "$R/run"

# Documentation/admin-guide/cgroup-v2.rst ("nsdelegate"), cgroup-v1/cpusets.rst
CG=$R/sys/fs/cgroup
case "$CGROUP" in
v2) mount -t cgroup2 -o nsdelegate cgroup2 "$CG" || die "cgroup2 mount failed" ;;
v1)
	mount -t tmpfs -o mode=755 cgroup "$CG"
	for c in cpuset cpu,cpuacct memory pids freezer devices; do
		mkdir "$CG/$c" && mount -t cgroup -o "$c" cgroup "$CG/$c" || die "cgroup v1 $c mount failed"
	done
	ln -s cpu,cpuacct "$CG/cpu" && ln -s cpu,cpuacct "$CG/cpuacct"
	;;
hybrid) # v1 cpuset and memory, cgroup2 at unified (systemd's hybrid layout)
	mount -t tmpfs -o mode=755 cgroup "$CG"
	for c in cpuset memory; do
		mkdir "$CG/$c" && mount -t cgroup -o "$c" cgroup "$CG/$c" || die "cgroup v1 $c mount failed"
	done
	mkdir "$CG/unified" && mount -t cgroup2 cgroup2 "$CG/unified" || die "cgroup2 mount failed"
	;;
*) die "unknown CGROUP=$CGROUP in vm.conf" ;;
esac

hostname ps-guest
ip link set lo up
mkdir "$R/run/ps-guest" && cp /out/job.sh "$R/run/ps-guest/job.sh" || die "no /out/job.sh"
chroot "$R" /bin/bash /run/ps-guest/job.sh </dev/null >/out/stdout 2>/out/stderr
echo $? >/out/rc.tmp && mv /out/rc.tmp /out/rc
sync
umount /out
poweroff -f
