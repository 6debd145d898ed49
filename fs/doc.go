// Package fs is the hermesfs overlay: a FUSE file system (go-fuse v2, imported
// as fusefs) that shows a read-only lower layer (an archive, see Lower) under
// a writable upper layer (a local directory), like overlayfs, but entirely
// unprivileged and with a point-in-time snapshot of the merged tree (Freeze).
//
//	m, err := fs.Mount(ctx, "/home/me/.hermes", fs.Options{Upper: state + "/upper", Lower: reader})
//	...
//	v, err := m.Freeze(ctx)             // the tree at one instant, as an io/fs.FS
//	archive.Pack(ctx, out, v, archive.PackOptions{})
//	v.Close()
//	m.Unmount(ctx)
//
// # Layers
//
// A name resolves to the upper entry if there is one, else to the lower entry
// unless a whiteout hides it. A directory present in both merges them: its
// listing is the upper entries plus the lower ones not hidden or shadowed,
// sorted by name. Nodes stand for inodes, not paths (go-fuse keeps one per
// st_ino and generation): a node knows its lower inode and whether it exists
// in the upper layer; its path is found through the tree when an upper
// object must be reached. Every upper access goes through directory file
// descriptors and *at() calls resolved beneath the upper root without
// following symlinks (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS), so paths
// longer than PATH_MAX work and nothing can lead outside the upper directory.
// The kernel locks only the parents of a rename, so an ancestor of a
// directory may move while an operation in it runs: the directory opened by
// path is checked to be the node's own by its upper inode number and looked
// up again if not (dirFd).
//
// # Upper-layer representation
//
// Everything the overlay keeps for itself lives in the upper directory under
// names starting with ".wh.", which users can neither create nor see
// (creating one fails with EINVAL; lower entries with such names stay
// visible but cannot be changed). No xattrs, no device nodes, no privileges:
//
//	.wh.NAME               whiteout: the lower entry NAME of this directory is deleted
//	.wh..wh..hHEX          whiteout of a name too long for the prefix (sha256 of
//	                       the name; the file holds the name)
//	.wh..wh..opq           opaque: this directory merges no lower directory
//	.wh..wh..dir           redirect: this directory merges the lower directory
//	                       whose path the file holds (it was renamed)
//	.wh..wh..ino           (root) the inode map, see below
//	.wh..wh..work/         (root) temporaries, guarded staging, freeze sidecars;
//	                       emptied at every mount
//	.wh..wh..part/         (root) present-maps of files copied up by range
//	                       (partial.go), named UPPERINO-BIRTHTIME; each also
//	                       records its file's path, which a copy of the
//	                       state dir keeps (partial_names.go)
//
// Adopt (adopt.go) writes the same layout without a mount: it takes what
// the mountpoint directory gained while no mount covered it into the upper
// layer, beside whatever the merged tree holds at a name, never over it.
//
// An upper entry and a whiteout of the same name may coexist: the upper entry
// wins. That ordering is what makes each operation crash-safe with no journal:
// a whiteout is made durable (file, then fsync of its directory) before the
// upper entry that hid the lower one goes away, so a crash leaves the state
// before or after the operation, never a deleted lower entry back from the
// dead. Copy-ups and new opaque directories are built in the work directory,
// synced and renamed into place. Overlay metadata is fsynced before the
// operation returns; ordinary creates, writes and renames are as durable as
// the user makes them (fsync of files and directories is passed to the upper
// file system and never waits on the network).
//
// # Copy-up
//
// The first change to a lower object (a writable open, truncate, chmod,
// chown, utimes, link, rename) copies it up with its parent directories,
// keeping mode, owner (when the daemon may chown) and mtime. Files are copied
// with their content (holes where the content is zeros) unless the change
// truncates them to nothing; the copy is made in the work directory and
// renamed into place, so readers see the lower file until the copy is
// complete. Directories are copied up empty and keep merging their lower
// directory. A lower file with several names is copied up once and its other
// names become upper hard links to the copy (names under a renamed or
// deleted parent are left alone). A read-only handle opened on the lower
// file before the copy-up reads the upper copy after it.
//
// Regular files of Options.CopyUpByRangeMin or more are copied up by range
// instead (partial.go): the copy starts sparse at the lower size with an
// empty present-map, each change first copies in the blocks it touches,
// reads merge the upper blocks present with the lower layer, and a
// background copy completes the file, after which it reads as an ordinary
// one. Every reader of upper bytes that may meet such a file (handles, the
// freeze's saving of frozen bytes, the view) asks overlay.partials first
// (partialSet.get); a partial file never gets passthrough. Every change of
// its bytes (write, truncate, fallocate) records first, in the map, which
// bytes may now differ from the lower file's (partialSet.track,
// partial_changes.go), complete or not, so the view offers the file to
// the packer as an archive.PartialSource: only the changed blocks are read
// and compressed. A tracked file's writable opens are served by the
// daemon; one the kernel forces into passthrough counts all as changed.
//
// A copy of the state dir made while the daemon runs reads a partial file
// and its map at different moments, so a copied map (its self record is
// not its own inode) is checked against its copied file before the mount
// serves it (partial_copied.go): every block it calls present is compared
// with the lower file. Where the map says a range never changed, the lower
// bytes are right (changes are recorded before they are made) and are
// written back over whatever the copy holds, holes included; where it says
// changed, the copy's bytes are the user's, unless the copy may have read
// the block before it came in: a 512-byte sector of zeros over lower data
// cannot be told from the user's own zeros, and when the copy gives reason
// to doubt (the file and map disagreed elsewhere, or the map was copied
// from a daemon that was running or killed) the mount is refused naming
// the file. Neither zeros nor lower bytes are ever guessed.
//
// Renaming works for lower files and whole lower directories and never
// returns EXDEV: the file is copied up first; a directory takes a redirect
// marker naming the lower directory it merges (opaque if it merges none)
// before it moves, so it shows the same tree at its new place and nothing of
// a lower directory already there. A directory removed and made again is
// opaque from its first instant (built in the work directory with its
// marker).
//
// # Inode numbers
//
// st_ino is stable for an object's life, across copy-up, rename and remount:
// lower objects report their squashfs inode number (below 2^32); objects born
// in the upper layer report their upper inode number plus 2^32, so the two
// ranges never collide; hard links share one number. A copied-up file keeps
// its lower number: the copy-up records (upper inode, birth time) -> number
// in the inode map (an fsynced append-only log) before the copy becomes
// visible, so after a remount, a crash included, the upper file reports the
// lower number again. A guarded file replaced by its staged content keeps its
// number the same way. Records whose birth time no longer matches belong to
// deleted files and are ignored. A number a record keeps for another inode
// (a guarded file's, whose old upper inode is gone) is claimed: the upper
// file system reuses the old inode's number, and the inode that gets it
// reports a number allocated to it (from 2^62 on, recorded the same way)
// instead of its own plus 2^32, so no two live objects share a number.
// Directory listings stat the entries the map knows, for the same d_ino. A
// merged directory reports its lower number. Numbers hold for the life of
// the lower layer, and across lower layers: a snapshot packed by extending
// (or compacting) an image of this lineage keeps the number of every
// object it carries over, a changed one included (View.BaseInode gives the
// pack the lower numbers), so a mount on the next snapshot reports the
// same numbers. An object born in the upper layer gets its snapshot
// number when packed; a mount on that snapshot reports it from then on.
//
// # Kernel I/O modes
//
// Lower files are opened with FOPEN_KEEP_CACHE (their content never
// changes); a sequential reader has the next MiB decompressed ahead of it,
// and a small file's content is handed to the page cache at its first open,
// so that reading it takes no READ (lowerfill.go).
// Upper files are served by the daemon with the page cache, except
// read-only opens of files of Options.PassthroughMinSize or more, which use
// FUSE passthrough where the kernel allows it (kernel >= 6.9 and
// CAP_SYS_ADMIN; otherwise it is off, silently): for small files the page
// cache kept across opens beats the two ioctls passthrough costs per open.
// Writable opens of upper files of at most Options.PassthroughWriteMax
// bytes use passthrough too, except while a view is open: the kernel
// writes them without a round trip, and a freeze stops those writes with a
// barrier and copies the files whole (ptwrite.go). Other writable opens
// are daemon-served, so the freeze sees and can hold each write; the
// writeback cache is off for the same reason. Directories are opened
// without OPENDIR requests (readdir.go), their listings cached by the
// kernel, and entries and attributes for an hour: every
// change goes through the kernel, which updates its caches itself (a
// guarded commit, made behind its back, is announced). The kernel allows
// one backing file per inode and, while an inode has a passthrough open,
// refuses non-passthrough opens of it: an open arriving then is given
// passthrough with FOPEN_DIRECT_IO, which sends read(2) and write(2) to
// the daemon anyway (only mmap of such a handle reaches the file
// directly). The overlay manages backing-file registration itself
// (passthrough.go). Locks (flock,
// fcntl) are left to the kernel: correct on one host, and go-fuse's lock
// operations hang. Xattrs are disabled (ENOTSUP); each write would otherwise
// cost a getxattr round trip.
//
// # Freeze
//
// Every operation that changes the upper layer holds the gate shared
// (gate.go). Freeze closes it: new mutations wait, those in flight finish,
// the instant is noted (generation, inode map, the upper root's status),
// and the gate opens again. Mutations are blocked for a constant time,
// whatever the upper layer holds: nothing is listed, stat'ed or copied.
//
// The View is copy-on-write until it is closed. Before a mutation changes
// the upper layer it keeps, for every open view, what the change would
// lose (freeze.go, the keep functions): a directory's listing (names,
// inode numbers, types, symlink targets, whiteouts, markers) before its
// first change of entries, including a directory that is about to move (it
// gets a marker) or go; an inode's status before its first change
// (contents, attributes, links; a directory's status with its listing);
// the 16 KiB blocks a write, truncate or fallocate changes inside a
// regular file's frozen size, saved once each to a sparse sidecar file
// (same offsets) in the work directory; and a regular file about to lose a
// name (unlink, rename over it, a guarded commit), pinned by a descriptor
// (beyond a budget, by a hard link in the work directory). Inodes the
// overlay creates after the freeze are noted under the same hold of the
// gate and cost nothing. Only atimes and ctimes are not kept: archives
// hold neither. Files open for writing with passthrough cannot be copied
// on write: Freeze stops their writes (a barrier in the kernel) before it
// closes the gate and copies them whole into the view before letting the
// writes go on (ptwrite.go). Seal, a stop's last freeze, never opens the
// gate again (mutations fail with EROFS) and revokes the passthrough
// writers instead (their I/O fails with EIO): its view is the last state
// any writer was told succeeded. Requests the daemon makes to its own
// mount run on threads of their own (ownmount.go), so a kill never leaves
// one stranded.
//
// What nothing has changed, the view reads from the upper layer when it
// first needs it, and keeps: a listing in its directory's slot, a status
// under the inode's attrMu, which the keeping takes too, so a change cannot
// begin in between; whatever reaches the view after that was kept before
// it changed. The view finds an upper object through its path in the
// frozen tree, as moved by later renames, checked by inode number, or its
// pin. Renames are logged in the order the upper file system made them
// (they are serialised while views are open, with the directories' paths
// read back from their descriptors), and a view resolves a path under the
// same lock. The lower layer is immutable and needs nothing. Close drains
// mutations in flight, then drops sidecars and pins.
//
// Mmap writes reach the overlay as writes when the kernel writes the pages
// back, like any file system; a snapshot holds what was written back by the
// freeze, which is what a crash at that instant would leave.
//
// # Guarded files
//
// For a path the Guard guards (the memory files), changes are all or
// nothing. A writable open stages the content in the work directory (a copy
// of the current content, made at the first write, unless O_TRUNC); the
// handle reads its own writes; it uses direct I/O so neither the page cache
// nor a shared mapping can go around the staging (shared writable mmap fails
// with ENODEV). At close(2) (FLUSH) the staged content is handed to
// Guard.Check with the old content; accepted, it replaces the file by one
// rename (synced, same st_ino); rejected, it is dropped and close fails with
// EFBIG or EPERM, the file untouched. A FLUSH commits only content that was
// written: the first close of a shell redirect (open O_TRUNC, dup2, close)
// must not commit an empty file; an O_TRUNC with no write at all is committed
// at release. A Guard that also implements GuardWriteChecker is asked at
// every write too, so a writer that ignores close(2) (a shell appending past
// the limit, or appending blocked content) sees the write fail; it is told
// whether the handle can only append (O_APPEND), since only then is content
// already written certain to stay. A file created by the writer whose first
// content is refused is removed again: a refused creation leaves no file. rename(2) of a file over a guarded name, truncate(2) of one,
// and a directory rename that brings one are checked the same way before they
// happen. Symlinks, device nodes and hard links cannot be made at a guarded
// name, a guarded file cannot get a second name, and a file still open for
// writing cannot be renamed over one (EBUSY). Other files pay nothing.
//
// # Lock order and concurrency
//
// node.mu (copy-up, open accounting) may be held when entering the gate,
// never the other way round; a copy-up reads and writes its copy outside the
// gate and holds it only to rename it into place, so a freeze never waits for
// a large copy. A mutation keeps for views while it holds the gate, taking
// a directory's listing slot or a captured inode's attrMu without holding
// the rename lock (viewSet.renameMu); a view takes a slot or attrMu, then
// the rename lock to find what it reads, never the other way round.
// While files copied up by range exist, renames and unlinks hold
// partialSet.nameMu exclusively (inside the gate, outside the rename
// lock), so their maps record names in the order they change; otherwise
// shared. View.capMu guards only the view's maps and is never held across a
// listing. View.mu guards the rename log and pins; capInode.mu serialises
// the saving of one file's blocks against View reads. FUSE methods return
// only syscall.Errno; the FUSE request context is cancelled by any signal to the
// caller, so work that must complete (copy-up, a Guard's audit append) does
// not follow it.
//
// # Ownership and modes
//
// The mount is the owner's unless Options.AllowOther (a root daemon serving
// another user's home); either way default_permissions makes the kernel
// check modes, which the overlay reports exactly (NullPermissions), so
// sticky and setgid directories and chown/chmod rights work as on a local
// disk.
// A privileged daemon gives new entries the caller's uid and gid (the
// directory's gid under a setgid directory); an unprivileged one (mounting
// through fusermount3) owns everything it creates, and its user is then the
// only user of the mount. The kernel applies the caller's umask before
// CREATE, MKDIR and MKNOD; the daemon's own umask is not changed (it is read
// from /proc/self/status) and a mode it would have narrowed is set again
// explicitly with fchmod, so the daemon's other files keep the process
// umask.
package fs
