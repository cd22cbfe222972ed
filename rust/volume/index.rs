//! The prefix index: a radix tree over token ids whose edges are KV blocks.
//!
//! Each namespace (model, layer range, tenant) has its own tree. A node at depth `d` stands
//! for one block of [`BLOCK_POSITIONS`] ids — `ids[(d−1)·B, d·B)` of every prefix that
//! passes through it — so the path to a node spells out the ids `[0, d·B)` and the node is
//! the natural home of that block's KV: the resident volumes that pass through it share one
//! [`KvBlock`]. Children are kept sorted by their ids, and each node also lists the cached
//! prefixes that end within its next block (by their remaining fewer-than-B ids).
//!
//! Lookups compare ids, never hashes:
//! - longest shared prefix: descend while a child holds the probe's next B ids exactly,
//!   then compare the probe's remaining ids with the two sorted neighbours among the
//!   children and among the prefixes ending there (in sorted order the longest common prefix
//!   with a probe is always attained at a neighbour of the probe). Cost `O(len/B · log k · B)`
//!   for `k` children per node, whatever the number of entries.
//! - the exact probe uses the cache's digest map instead and compares the ids once.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use super::block::{KvBlock, BLOCK_POSITIONS};
use super::key::Namespace;

/// The cache's id of an entry.
pub(super) type EntryId = u32;

/// Index of a node in the tree's arena.
pub(super) type NodeId = u32;

const NO_PARENT: NodeId = NodeId::MAX;

/// Up to [`BLOCK_POSITIONS`] ids held inline, ordered as the slice they spell: a tree key
/// compared without following a pointer (the tree's wide nodes are searched by comparing
/// many keys).
#[derive(Clone, Copy)]
struct BlockIds {
    len: u8,
    ids: [u32; BLOCK_POSITIONS],
}

impl BlockIds {
    fn new(ids: &[u32]) -> Self {
        let mut inline = [0; BLOCK_POSITIONS];
        inline[..ids.len()].copy_from_slice(ids);
        BlockIds {
            len: ids.len() as u8,
            ids: inline,
        }
    }
}

impl BlockIds {
    fn as_slice(&self) -> &[u32] {
        &self.ids[..usize::from(self.len)]
    }
}

impl Borrow<[u32]> for BlockIds {
    fn borrow(&self) -> &[u32] {
        self.as_slice()
    }
}

impl PartialEq for BlockIds {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for BlockIds {}

impl PartialOrd for BlockIds {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for BlockIds {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl std::fmt::Debug for BlockIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

#[derive(Debug)]
struct Node {
    /// This node's B ids (empty for a root).
    ids: BlockIds,
    parent: NodeId,
    /// Children by their ids.
    children: BTreeMap<BlockIds, NodeId>,
    /// Entries whose prefix ends inside the next block, by the ids after this node.
    ends: BTreeMap<BlockIds, EntryId>,
    /// Entries ending here or below (the node goes when none is left).
    entries_below: u32,
    /// The KV of this node's block, while a resident entry uses it.
    block: Option<Arc<KvBlock>>,
    /// Resident entries using `block`.
    block_users: u32,
}

impl Node {
    fn new(ids: BlockIds, parent: NodeId) -> Self {
        Node {
            ids,
            parent,
            children: BTreeMap::new(),
            ends: BTreeMap::new(),
            entries_below: 0,
            block: None,
            block_users: 0,
        }
    }
}

/// Every cached prefix, by namespace, as a tree of B-id blocks.
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    roots: HashMap<Namespace, NodeId>,
    nodes: Vec<Node>,
    free: Vec<NodeId>,
}

/// Number of ids `a` and `b` agree on from the start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Among `map`'s keys, the one sharing the longest prefix with `probe` and that length.
///
/// A neighbour of `probe` in sorted order attains the longest shared prefix `P`; the keys
/// sharing it form a run that starts with `P` itself, so the run's first key that goes on past
/// `P` (or else `P`) is found in two steps. That key is the answer: one that goes past the
/// shared part covers all of it even if its trailing position was erased, and the first of
/// the run is a stable choice, so repeated probes credit their hits to the same entry (a
/// frequency-aware policy then sees the prefix's popularity rather than a share of it).
fn closest<V: Copy>(map: &BTreeMap<BlockIds, V>, probe: &[u32]) -> Option<(usize, V)> {
    let below = map
        .range::<[u32], _>((Bound::Unbounded, Bound::Included(probe)))
        .next_back();
    let above = map
        .range::<[u32], _>((Bound::Excluded(probe), Bound::Unbounded))
        .next();
    let shared = [below, above]
        .into_iter()
        .flatten()
        .map(|(k, _)| common_prefix(k.as_slice(), probe))
        .max()?;
    let run = &probe[..shared];
    let mut first = map.range::<[u32], _>((Bound::Included(run), Bound::Unbounded));
    let (k, &v) = first
        .next()
        .expect("the run holds the neighbour that attains it");
    if k.as_slice().len() > shared {
        return Some((shared, v));
    }
    // `k` is `P` itself: the next key of the run, if any, goes on past it.
    match first.next() {
        Some((next, &w)) if next.as_slice().starts_with(run) => Some((shared, w)),
        _ => Some((shared, v)),
    }
}

impl PrefixIndex {
    /// Registers `entry` for `tokens` (non-empty) in `namespace`; returns the nodes of its
    /// full blocks, root excluded (`tokens.len() / B` of them).
    pub(super) fn insert(
        &mut self,
        namespace: Namespace,
        tokens: &[u32],
        entry: EntryId,
    ) -> Box<[NodeId]> {
        let root = match self.roots.get(&namespace) {
            Some(&r) => r,
            None => {
                let r = self.alloc(Node::new(BlockIds::new(&[]), NO_PARENT));
                self.roots.insert(namespace, r);
                r
            }
        };
        let mut node = root;
        self.nodes[node as usize].entries_below += 1;
        let full = tokens.len() / BLOCK_POSITIONS;
        let mut path = Vec::with_capacity(full);
        for block in tokens.chunks_exact(BLOCK_POSITIONS) {
            let existing = self.nodes[node as usize].children.get(block).copied();
            let child = match existing {
                Some(c) => c,
                None => {
                    let c = self.alloc(Node::new(BlockIds::new(block), node));
                    let children = &mut self.nodes[node as usize].children;
                    children.insert(BlockIds::new(block), c);
                    c
                }
            };
            node = child;
            self.nodes[node as usize].entries_below += 1;
            path.push(node);
        }
        let rest = &tokens[full * BLOCK_POSITIONS..];
        let previous = self.nodes[node as usize]
            .ends
            .insert(BlockIds::new(rest), entry);
        debug_assert!(previous.is_none(), "one entry per prefix and namespace");
        path.into_boxed_slice()
    }

    /// Unregisters `entry`, registered for `tokens` with nodes `path`; prunes the nodes no
    /// entry uses any more.
    pub(super) fn remove(&mut self, namespace: Namespace, tokens: &[u32], path: &[NodeId]) {
        let root = self.roots[&namespace];
        let last = path.last().copied().unwrap_or(root);
        let rest = &tokens[path.len() * BLOCK_POSITIONS..];
        self.nodes[last as usize].ends.remove(rest);
        for &node in path.iter().rev().chain([root].iter()) {
            let n = &mut self.nodes[node as usize];
            n.entries_below -= 1;
            if n.entries_below == 0 {
                debug_assert!(n.children.is_empty() && n.ends.is_empty() && n.block_users == 0);
                let (parent, ids) = (n.parent, n.ids);
                if parent == NO_PARENT {
                    self.roots.remove(&namespace);
                } else {
                    self.nodes[parent as usize].children.remove(&ids);
                }
                self.nodes[node as usize] = Node::new(BlockIds::new(&[]), NO_PARENT);
                self.free.push(node);
            }
        }
    }

    /// The entry sharing the longest prefix with `probe` in `namespace`, and the number of
    /// ids shared (at least 1), or `None` if no entry shares even one id.
    ///
    /// Where several entries share as many ids, one is picked by a fixed rule, preferring one
    /// whose prefix goes on past the shared part (so all of it is covered even if its trailing
    /// position was erased).
    pub(super) fn longest(&self, namespace: Namespace, probe: &[u32]) -> Option<(EntryId, usize)> {
        let mut node = *self.roots.get(&namespace)?;
        let mut depth = 0;
        loop {
            let n = &self.nodes[node as usize];
            let rest = &probe[depth..];
            if rest.len() >= BLOCK_POSITIONS {
                if let Some(&child) = n.children.get(&rest[..BLOCK_POSITIONS]) {
                    node = child;
                    depth += BLOCK_POSITIONS;
                    continue;
                }
            }
            let window = &rest[..rest.len().min(BLOCK_POSITIONS)];
            let child = closest(&n.children, window).filter(|&(l, _)| l > 0);
            let end = closest(&n.ends, window).filter(|&(l, _)| l > 0);
            return match (child, end) {
                (Some((lc, _)), Some((le, e))) if le > lc => Some((e, depth + le)),
                (Some((lc, c)), _) => Some((self.any_entry_below(c), depth + lc)),
                (None, Some((le, e))) => Some((e, depth + le)),
                (None, None) if depth > 0 => Some((self.entry_past(node), depth)),
                (None, None) => None,
            };
        }
    }

    /// Some entry registered at `node` or below.
    fn any_entry_below(&self, mut node: NodeId) -> EntryId {
        loop {
            let n = &self.nodes[node as usize];
            if let Some((_, &e)) = n.ends.iter().next() {
                return e;
            }
            node = *n
                .children
                .values()
                .next()
                .expect("a live node has an entry below");
        }
    }

    /// Some entry registered below `node` whose prefix goes past it, else the one ending
    /// exactly at it.
    fn entry_past(&self, node: NodeId) -> EntryId {
        let n = &self.nodes[node as usize];
        if let Some((_, &e)) = n.ends.iter().find(|(rest, _)| rest.len > 0) {
            return e;
        }
        match n.children.values().next() {
            Some(&c) => self.any_entry_below(c),
            None => n.ends[&[][..]],
        }
    }

    /// The resident KV block of each node of `path` (`None` where no resident entry holds it).
    pub(super) fn cached_blocks(&self, path: &[NodeId]) -> Vec<Option<Arc<KvBlock>>> {
        path.iter()
            .map(|&n| self.nodes[n as usize].block.clone())
            .collect()
    }

    /// The full-block nodes `tokens` would take in `namespace`, as far as they exist.
    pub(super) fn existing_path(&self, namespace: Namespace, tokens: &[u32]) -> Vec<NodeId> {
        let mut path = Vec::new();
        let Some(&root) = self.roots.get(&namespace) else {
            return path;
        };
        let mut node = root;
        for block in tokens.chunks_exact(BLOCK_POSITIONS) {
            match self.nodes[node as usize].children.get(block) {
                Some(&c) => {
                    path.push(c);
                    node = c;
                }
                None => break,
            }
        }
        path
    }

    /// One more resident user of `node`'s block. If the node holds none yet it takes
    /// `block`, and the bytes newly held are returned (0 when the block was already held).
    pub(super) fn share_block(&mut self, node: NodeId, block: &Arc<KvBlock>) -> usize {
        let n = &mut self.nodes[node as usize];
        n.block_users += 1;
        if n.block.is_some() {
            0
        } else {
            n.block = Some(Arc::clone(block));
            block.nbytes()
        }
    }

    /// One resident user less of `node`'s block; when none is left the node lets the block
    /// go and the bytes released are returned.
    pub(super) fn release_block(&mut self, node: NodeId) -> usize {
        let n = &mut self.nodes[node as usize];
        n.block_users -= 1;
        if n.block_users == 0 {
            n.block.take().map_or(0, |b| b.nbytes())
        } else {
            0
        }
    }

    /// The block `node` holds, if a resident entry uses it.
    pub(super) fn block(&self, node: NodeId) -> Option<&Arc<KvBlock>> {
        self.nodes[node as usize].block.as_ref()
    }

    /// Nodes alive (roots included), for tests of pruning.
    #[cfg(test)]
    pub(super) fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                NodeId::try_from(self.nodes.len() - 1).expect("fewer than 2^32 nodes")
            }
        }
    }
}
